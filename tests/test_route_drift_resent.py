"""Route drift with tables re-sent as vLLM sends them (base64 ``.npy``, every row each call),
on both backends: a call that re-sent every recorded row unchanged is held as the recorded
rows without a copy, and later calls are still compared with the rows first recorded; rows
found equal are not scanned again for ``num_experts``, a drifted one still is."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from helpers import finished, gen, started
from sqlalchemy import text

from trajstore.events._wire import encode_npy_b64
from trajstore.errors import ValidationError


def rows(values, layers=2, topk=2):
    """One row per value, every entry of the row = that value."""
    return np.repeat(np.asarray(values, np.uint8), layers * topk).reshape(len(values), layers, topk)


def call(seq: int, table: np.ndarray) -> dict:
    """Call ``seq``: a prompt of ``len(table) + 1`` tokens, no output, ``table`` as vLLM's base64 .npy."""
    return gen("t", seq, range(len(table) + 1), [], routed_experts=encode_npy_b64(table))


def drift(store):
    with store.log.read_engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(
            "SELECT seq, route_rows_resent, route_rows_drifted FROM generation_events ORDER BY seq"))]


def test_a_resent_table_is_held_as_recorded_and_later_drift_is_against_the_first_rows(store):
    first = rows([1, 2, 3, 4])
    store.append([started("t", num_experts=16), call(0, first)])
    store.append([call(1, np.concatenate([first, rows([5, 6])]))])  # all re-sent rows equal
    (_, held), = store._routes._entries.values()
    assert len(held.chunks) == 1 and len(held.chunks[0][1]) == 6  # the call's whole table ...
    assert not held.chunks[0][1].flags.writeable and held.nbytes == 6 * 4  # ... as decoded, no copy

    moved = np.concatenate([first, rows([5, 6, 7, 8])])
    moved[1] = 9  # position 1 recomputed differently: drifted, and not recorded
    store.append([call(2, moved)])
    again = np.concatenate([first, rows([5, 6, 7, 8, 9, 10])])  # the first rows again: no drift
    store.append([call(3, again)])
    assert drift(store) == [(0, 0, 0), (1, 4, 0), (2, 6, 1), (3, 8, 0)]

    bad = np.concatenate([first, rows([5, 6, 7, 8, 9, 10, 11, 12])])
    bad[2, 1, 0] = 16  # a re-sent row drifted to an expert id over num_experts: still refused
    with pytest.raises(ValidationError, match="expert id 16") as e:
        store.append([call(4, bad)])
    assert e.value.rule == "expert_id_range"
    bad[2, 1, 0] = 3
    bad[-1, 0, 1] = 16  # a new row over it: refused
    with pytest.raises(ValidationError, match="expert id 16"):
        store.append([call(4, bad)])
    bad[-1, 0, 1] = 12
    store.append([call(4, bad)])
    assert drift(store)[-1] == (4, 10, 0)


def test_a_batch_of_resent_calls_gives_the_figures_of_one_call_per_append(store):
    t0 = rows([1, 2, 3])
    t1 = np.concatenate([t0, rows([4, 5])])
    t2 = np.concatenate([t0, rows([4, 5, 6, 7])])
    t2[0] = 8
    t3 = np.concatenate([t0, rows([4, 5, 6, 7, 8, 9])])
    store.append([started("t", num_experts=16), call(0, t0), call(1, t1), call(2, t2), call(3, t3)])
    assert drift(store) == [(0, 0, 0), (1, 3, 0), (2, 5, 1), (3, 7, 0)]


def test_a_changed_character_in_the_resent_base64_is_drift_and_the_recorded_row_stays(store):
    """vLLM's layout (48 x 8 uint8 ids, every row re-sent as base64 .npy): one character changed
    in the middle of the re-sent rows' text is a drifted row, counted, and the sample keeps the
    row first recorded (routes are appended, never overwritten)."""
    rng = np.random.default_rng(7)
    first = rng.integers(0, 256, (300, 48, 8), dtype=np.uint8)
    table = np.concatenate([first, rng.integers(0, 256, (200, 48, 8), dtype=np.uint8)])
    store.append([started("t", num_experts=256), call(0, first)])
    text = encode_npy_b64(table)
    head = base64.b64decode(text[:16])  # .npy v1: magic, version, 2-byte header length
    assert head[:8] == b"\x93NUMPY\x01\x00"
    byte = 10 + int.from_bytes(head[8:10], "little") + 150 * 48 * 8 + 100  # inside row 150, a re-sent row
    at = 4 * (byte // 3) + 1  # a character of that byte's quantum, not of a neighbouring row's
    changed = text[:at] + ("A" if text[at] != "A" else "B") + text[at + 1:]
    sent = np.lib.format.read_array(io.BytesIO(base64.b64decode(changed)))
    differs = np.flatnonzero((sent != table).reshape(len(table), -1).any(axis=1))
    assert differs.tolist() == [150]  # the changed character changed row 150 only
    result = store.append([gen("t", 1, range(len(table) + 1), [], routed_experts=changed), finished("t")])
    assert (result.route_rows_resent, result.route_rows_drifted) == (300, 1)
    assert result.num_appended == 2 and drift(store) == [(0, 0, 0), (1, 300, 1)]
    store.materialize()
    (sample,) = list(store.samples())
    assert np.array_equal(sample.routed_experts[:300], first)  # row 150 as first recorded
    assert np.array_equal(sample.routed_experts[300:500], table[300:])


@pytest.mark.parametrize("where", ["first", "last"])
def test_the_bytewise_comparison_of_resent_rows_finds_a_difference_in_any_byte(where):
    """``_same_bytes``: one memcmp over a table decoded from bytes, on either side; the
    same answer as ``np.array_equal`` for every layout it is given."""
    from trajstore._append.admission import _same_bytes, _words

    rng = np.random.default_rng(5)
    rows = rng.integers(0, 128, (300, 48, 8), dtype=np.uint8)
    raw = b"\x93NUMPY header" + rows.tobytes()  # a view at an offset in a bytes object, as decoded
    sent = np.frombuffer(raw, np.uint8, offset=13).reshape(rows.shape)
    kept = rows.copy()
    assert _same_bytes(_words(sent, kept.dtype), _words(kept, sent.dtype))
    assert _same_bytes(_words(kept, sent.dtype), _words(sent, kept.dtype))
    changed = kept.copy()
    changed.reshape(-1)[0 if where == "first" else -1] ^= 1
    for a, b in ((sent, changed), (changed, sent)):
        assert not _same_bytes(_words(a, b.dtype), _words(b, a.dtype))
    # a part of the table (the rows re-sent for recorded positions), and arrays of no bytes object
    assert _same_bytes(_words(sent[100:250], kept.dtype), _words(kept[100:250], sent.dtype))
    assert _same_bytes(_words(sent[:250], kept.dtype), _words(changed[:250], sent.dtype)) == (where == "last")
    assert _same_bytes(kept, rows.copy()) and not _same_bytes(kept, changed)
    wide = kept.astype(np.uint16)  # another dtype: compared by value, as np.array_equal does
    assert _same_bytes(_words(sent, wide.dtype), _words(wide, sent.dtype))
