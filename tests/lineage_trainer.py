"""A trainer process for the lineage crash test: reads with SampleReader, "trains"
(deterministic numbers from the batch), records each step's lineage, and
checkpoints the reader state every ``--every`` steps (atomically, the step it
resumes at with it). Restarted, it resumes from its last checkpoint and
replays the steps after it.

    python lineage_trainer.py STORE_URL RUN CHECKPOINT [--every 2] [--pause-after N MARKER] [--salt X]
                              [--policy JSON]

``--pause-after N MARKER``: after recording step N (before its checkpoint),
write MARKER and sleep (the test kills the process there: mid-step for the
next checkpoint). ``--salt``: added to the loss (a step redone differently).
``--policy``: the reader's sampling policy, as JSON (default fifo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import trajstore


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("run")
    p.add_argument("checkpoint")
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--pause-after", nargs=2, default=None)
    p.add_argument("--salt", type=float, default=0.0)
    p.add_argument("--policy", type=json.loads, default='"fifo"')
    args = p.parse_args()
    reader = trajstore.SampleReader(args.url, batch_size=2, policy=args.policy)
    step = 0
    if os.path.exists(args.checkpoint):
        with open(args.checkpoint) as f:
            saved = json.load(f)
        reader.load_state_dict(saved["reader"])
        step = saved["step"]
    for batch in reader:
        loss = float(sum(int(s.response_ids.sum()) for s in batch)) / 1000 + args.salt
        annotations = {(s.trajectory_id, s.sample_index): {
            "trainer_logprobs": (s.rollout_logprobs - 0.01).astype(np.float32),
            "advantages": float(s.reward or 0.0)} for s in batch}
        done = reader.record_step(step, run=args.run, policy_version=step, metrics={"loss": loss},
                                  annotations=annotations)
        print(f"step {step} attempt {done.attempt} replayed {done.replayed}", flush=True)
        if args.pause_after is not None and step == int(args.pause_after[0]):
            with open(args.pause_after[1], "w") as f:
                f.write(str(step))
            time.sleep(600)
        step += 1
        if step % args.every == 0:
            tmp = args.checkpoint + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"reader": reader.state_dict(), "step": step}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, args.checkpoint)
    reader.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
