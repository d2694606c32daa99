"""Build a tiny random Qwen3-MoE checkpoint that vLLM serves on CPU (nothing from a hub).

``python tiny_model.py DIR`` writes ``config.json``, ``model.safetensors``
(float32, HF names), and a word-level tokenizer (``tokenizer.json`` made with
``tokenizers``, one word per id: ``w0 w1 ...``). Runs with numpy,
safetensors and tokenizers only, so any of the project's virtualenvs can
run it.

One token, ``FLOOR_TOKEN``, has a logit of about -16,000 at every position:
residual dimension 0 holds a constant (every embedding has 1.0 there and no
layer writes to it), so after the final RMSNorm it is about sqrt(hidden),
and the token's lm_head row is -2,000 on that dimension. Forced with
``allowed_token_ids``, vLLM samples it and reports its logprob as -9999.0
(the OpenAI shapes' floor).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

VOCAB = 256
HIDDEN = 64
LAYERS = 2
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 32
EXPERTS, TOPK, MOE_INTER = 4, 2, 32
EOS = 1
FLOOR_TOKEN = 7


def build(out: Path, seed: int = 0) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    def w(*shape: int, std: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    tensors: dict[str, np.ndarray] = {}
    embed = w(VOCAB, HIDDEN)
    embed[:, 0] = 1.0
    tensors["model.embed_tokens.weight"] = embed
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        tensors[p + "self_attn.q_proj.weight"] = w(HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = w(KV_HEADS * HEAD_DIM, HIDDEN)
        o_proj = w(HIDDEN, HEADS * HEAD_DIM)
        o_proj[0] = 0.0  # nothing writes to residual dimension 0
        tensors[p + "self_attn.o_proj.weight"] = o_proj
        tensors[p + "self_attn.q_norm.weight"] = np.ones(HEAD_DIM, np.float32)
        tensors[p + "self_attn.k_norm.weight"] = np.ones(HEAD_DIM, np.float32)
        tensors[p + "mlp.gate.weight"] = w(EXPERTS, HIDDEN, std=0.5)
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            tensors[q + "gate_proj.weight"] = w(MOE_INTER, HIDDEN)
            tensors[q + "up_proj.weight"] = w(MOE_INTER, HIDDEN)
            down = w(HIDDEN, MOE_INTER)
            down[0] = 0.0
            tensors[q + "down_proj.weight"] = down
    tensors["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    # lm_head: a spread of ordinary logits (std 1 after the norm), the floor token far below
    head = w(VOCAB, HIDDEN, std=0.15)
    head[:, 0] = 0.0
    head[FLOOR_TOKEN, 0] = -2000.0
    head[EOS] -= 0.5  # a rare end: generations run to max_tokens
    tensors["lm_head.weight"] = head

    from safetensors.numpy import save_file

    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
        "num_experts": EXPERTS, "num_experts_per_tok": TOPK, "moe_intermediate_size": MOE_INTER,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
        "router_aux_loss_coef": 0.0, "tie_word_embeddings": False, "torch_dtype": "float32", "dtype": "float32",
        "bos_token_id": 0, "eos_token_id": EOS, "pad_token_id": 0,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": 0}))
    _tokenizer(out)
    return out


def _tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": EOS, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<eos>",
        "bos_token": None, "pad_token": "<unk>", "model_max_length": 8192,
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }))


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
