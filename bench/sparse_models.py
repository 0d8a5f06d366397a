"""How well each sparse model sees the true KL where the K cap binds: a near-uniform model and a tiny perturbation.

    .venv/bin/python bench/sparse_models.py                  # tiny Llama, untrained (near-uniform), noise 1e-4
    .venv/bin/python bench/sparse_models.py --noise 1e-2 --k 16

The old policy q is the untrained tiny Llama of the `tiny-cpu` preset (260-token byte vocabulary: K = 64 tokens
hold about a third of the mass, so every row is capped); the current policy p is the same model with every weight
perturbed by N(0, noise^2). Both score the same 64 prompts x 5 random completion tokens. Printed per model
(`rest`: q's kept set plus one exact rest atom; `paper`: each policy's own top-K with a 1e-12 tail): the sparse
KL(p || q) that decides whether a token is projected (mean, max), the fraction of tokens projected at eps =
0.05, next to the true KL over the full vocabulary (float64). A sparse KL above the true one projects tokens that
are inside the trust region.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if not __package__:  # run as a file (python bench/x.py): the repository root on the path, for `bench` and its troll
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._util import int_at_least, positive_float  # noqa: E402
from troll.base.cli import Parser, run_command
from troll.models.tiny import tiny_llama, train_tokenizer  # noqa: E402
from troll.policy import completion_logits  # noqa: E402
from troll.project import project_sparse  # noqa: E402
from troll.sparse import SUPPORTS, build_support, sparsify, support_kl  # noqa: E402
from troll.tasks import addition  # noqa: E402

PROG = "python bench/sparse_models.py"  # the name in each of its lines, argparse's own and run_command's


def main() -> None:
    ap = Parser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--noise", type=positive_float, default=1e-4, help="std of the weight perturbation")
    ap.add_argument("--k", type=int_at_least(1), default=64)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--eps", type=positive_float, default=0.05)
    ap.add_argument("--seed", type=int_at_least(0), default=0)
    args = ap.parse_args()
    if not 0 <= args.delta < 1:
        ap.error(f"--delta must be in [0, 1), got {args.delta}")
    tok = train_tokenizer(addition.corpus(), vocab_size=64)
    old_model = tiny_llama(tok, hidden=128, layers=2, heads=4, seed=args.seed).eval()
    new_model = copy.deepcopy(old_model)
    g = torch.Generator().manual_seed(args.seed)
    v = len(tok)
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(args.noise * torch.randn(p.shape, generator=g))
        prompts = [tok(r["question"], add_special_tokens=False)["input_ids"] for r in addition.problems("train")[:64]]
        completions = torch.randint(0, v, (64, 5), generator=g)
        lq = completion_logits(old_model, prompts, completions, 1.0, v).reshape(-1, v)
        lp = completion_logits(new_model, prompts, completions, 1.0, v).reshape(-1, v)
    y = completions.reshape(-1)
    p, q = lp.double().log_softmax(-1), lq.double().log_softmax(-1)
    true = (p.exp() * (p - q)).sum(-1)
    old = sparsify(lq, y, k=args.k, delta=args.delta)
    kept = float((-old.log_rest.exp()).log1p().exp().mean())
    print(
        f"{len(y)} tokens, V = {v}, K = {args.k}: q keeps {float(old.size.float().mean()):.1f} tokens, mass {kept:.3f}"
    )
    print(f"{'model':>8} {'KL mean':>10} {'KL max':>10} {'projected':>10}")
    outside = float((true > args.eps).float().mean())
    print(f"{'true':>8} {float(true.mean()):10.3g} {float(true.max()):10.3g} {outside:10.3f}")
    row = {}
    for model in SUPPORTS:
        s = build_support(lp, y, old, model, k=args.k, delta=args.delta)
        kl = support_kl(s)
        row[model] = float(project_sparse(s, args.eps).dual.active.float().mean())
        print(f"{model:>8} {float(kl.mean()):10.3g} {float(kl.max()):10.3g} {row[model]:10.3f}")
    print(
        f"SUMMARY tokens projected for no reason (true KL <= {args.eps} on all but "
        f"{int((true > args.eps).sum())}): rest {row['rest']:.3f}, paper {row['paper']:.3f}"
    )


if __name__ == "__main__":  # Ctrl-C: one line, then SIGINT
    run_command(PROG, main)
