"""Two trainkit runs trained the same, bit for bit: every step's loss, gradient norm and
tokens in their --log-json files, and their saved weights (DIR/log.jsonl and
DIR/model/model.safetensors). Exits 1, saying what differs, when they do not.

same_training.py A B [--norm-rtol R]: with R, the gradient norms need only agree within
R relative (an update inside backward adds the per-parameter squares in another order)."""
import filecmp
import json
import sys


def steps(run):
    with open(f"{run}/log.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["loss"], r["grad_norm"], r["tokens"]) for r in rows]


args = sys.argv[1:]
rtol = None
if "--norm-rtol" in args:
    i = args.index("--norm-rtol")
    rtol = float(args[i + 1])
    del args[i : i + 2]
a, b = args[0], args[1]
sa, sb = steps(a), steps(b)
print(f"{a}: {sa}")
print(f"{b}: {sb}")
if not sa or len(sa) != len(sb):
    sys.exit("the logs differ in length")
for n, (x, y) in enumerate(zip(sa, sb), 1):
    if rtol is None:
        same = x == y
    else:
        same = (x[0], x[2]) == (y[0], y[2]) and abs(x[1] - y[1]) <= rtol * abs(x[1])
    if not same:
        sys.exit(f"the logs differ at step {n}: {x} against {y}")
wa, wb = f"{a}/model/model.safetensors", f"{b}/model/model.safetensors"
if not filecmp.cmp(wa, wb, shallow=False):
    sys.exit(f"the saved weights differ: {wa} and {wb}")
norms = "gradient norm" if rtol is None else f"gradient norm (within {rtol:g})"
print(f"bitwise the same: every step's loss, {norms} and tokens, and the saved weights")
