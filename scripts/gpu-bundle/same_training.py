"""Two trainkit runs trained the same, bit for bit: every step's loss, gradient norm and
tokens in their --log-json files, and their saved weights (DIR/log.jsonl and
DIR/model/model.safetensors). Exits 1, saying what differs, when they do not."""
import filecmp
import json
import sys


def steps(run):
    with open(f"{run}/log.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["loss"], r["grad_norm"], r["tokens"]) for r in rows]


a, b = sys.argv[1], sys.argv[2]
sa, sb = steps(a), steps(b)
print(f"{a}: {sa}")
print(f"{b}: {sb}")
if not sa or sa != sb:
    sys.exit("the logs differ")
wa, wb = f"{a}/model/model.safetensors", f"{b}/model/model.safetensors"
if not filecmp.cmp(wa, wb, shallow=False):
    sys.exit(f"the saved weights differ: {wa} and {wb}")
print("bitwise the same: every step's loss, gradient norm and tokens, and the saved weights")
