"""See the trust region act, token by token: a run's per-token records (troll.records) as a page and as text.

    python -m troll.inspect runs/tiny-rare-troll runs/tiny-rare-ppo --step 20 --out page.html

prints, for each run, the step's recorded samples token by token (q, p before and after the update, KL before the
projection, projected or not, the raw and the projected ratio, and whether PPO-clip would have cut the token), and
with `--out` writes one self-contained HTML page: inline CSS and script, nothing fetched, it opens from disk; its
data is JSON with every `<`, `>`, `&`, U+2028 and U+2029 escaped, so no text it shows can end or stop its script. The
page shows each completion as its tokens, coloured by the quantity chosen at its top, the exact figures on hover
and on click, each run's settings and step, and two runs side by side. `page.html#pin=RUN.SAMPLE.TOKEN,...` opens
with those tokens' figures shown (`#pin=1.239.3`: the second run, sample 239, its fourth token). The page replaces a
file at `--out` as a tool's `-o` does, whole (a temporary file beside it, renamed over it: troll.outputs); a folder or
a symbolic link there is refused, the link left as it is and never written through. `--step` picks the
step (default: the last one every run recorded), `--colour` the colouring the page opens with. A missing or damaged
run file (each records row is checked field by field against troll.records' schema) is one line naming it, and for
a row its line and field (`troll.cli.run_command`), never a traceback.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from troll import outputs
from troll.cli import Parser, UsageError, run_command

PROG = "python -m troll.inspect"
SHOWN = ("task", "loss", "eps", "clip_low", "clip_high", "level", "support", "old_policy", "staleness", "lr",
         "prompts_per_step", "samples_per_prompt", "epochs", "minibatches", "seed", "steps")  # fmt: skip
TEXT_TOKENS = 24  # the terminal shows at most this many tokens of a sample (the page shows all)


def load(run: str) -> tuple[dict, list[dict]]:
    """A run's config (as saved) and its per-token records; UsageError naming what is missing or damaged."""
    from troll import records

    out = Path(run)
    if not out.is_dir():
        raise UsageError(f"{out} is not a run directory (no such folder): pass the --out of a troll.train run")
    path = out / "config.json"
    try:
        cfg = json.loads(path.read_text(), parse_constant=_not_json)
    except (OSError, ValueError) as e:
        reason = "does not exist" if isinstance(e, FileNotFoundError) else f"cannot be read ({e})"
        raise UsageError(f"{path} {reason}: pass the --out of a troll.train run") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{path} does not hold a JSON object: pass the --out of a troll.train run")
    return cfg, records.read(out)


def _not_json(name: str) -> None:
    """json.loads' hook for NaN and Infinity: no JSON value (JSON.parse refuses them), and troll never writes them."""
    raise ValueError(f"{name} is not JSON")


def pick_step(runs: list[tuple[str, dict, list[dict]]], step: int | None) -> int:
    """The step to show: `step`, which every run must have recorded, or the last step all of them recorded."""
    have = {name: [r["step"] for r in rows] for name, _, rows in runs}
    listed = "; ".join(f"{name}: {', '.join(map(str, steps))}" for name, steps in have.items())
    common = set.intersection(*(set(s) for s in have.values()))
    if step is None:
        if not common:
            raise UsageError(f"the runs recorded no step in common ({listed}): pass --step with one each has")
        return max(common)
    if step not in common:
        raise UsageError(f"--step {step} is not recorded in every run (recorded steps: {listed})")
    return step


def at_step(rows: list[dict], step: int) -> dict:
    return next(r for r in rows if r["step"] == step)


# ----------------------------------------------------------------------------- text


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def text_summary(name: str, cfg: dict, row: dict) -> str:
    """The step's records of one run as plain text: a head line, then each sample's tokens."""
    toks = [(s, t) for s in row["samples"] for t in range(len(s["text"]))]
    projected = sum(s["projected"][t] for s, t in toks)
    clipped = sum(s["clipped"][t] for s, t in toks)
    lines = [
        f"{name}: {cfg.get('loss', row['loss'])} at step {row['step']} (eps {row['eps']}, clip range "
        f"{row['clip_low']}/{row['clip_high']}): {len(row['samples'])} samples, {len(toks)} tokens, {projected} "
        f"projected (KL > eps), {clipped} that PPO-clip would cut",
        f"  {'token':>12} {'q':>9} {'p':>9} {'p after':>9} {'KL':>9} {'proj':>4} {'ratio':>7} {'ratio*':>7} clip",
    ]
    for s in row["samples"]:
        lines.append(f"  sample {s['index']}: advantage {_num(s['adv'])}, reward {_num(s['reward'])}, "
                     f"prompt {s['prompt'][-40:]!r}")  # fmt: skip
        for t, text in enumerate(s["text"][:TEXT_TOKENS]):
            lines.append(
                f"  {text[:12]!r:>12} {_num(s['q'][t]):>9} {_num(s['p'][t]):>9} {_num(s['p_after'][t]):>9} "
                f"{_num(s['kl'][t]):>9} {'yes' if s['projected'][t] else '':>4} {_num(s['ratio'][t]):>7} "
                f"{_num(s['ratio_proj'][t]):>7} {'cut' if s['clipped'][t] else ''}"
            )
        if len(s["text"]) > TEXT_TOKENS:
            lines.append(f"  ... {len(s['text']) - TEXT_TOKENS} more tokens (the page shows them all: --out)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the page

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
header { padding: 10px 16px; background: #fff; border-bottom: 1px solid #ddd; position: sticky; top: 0; z-index: 2; }
h1 { font-size: 17px; margin: 0 0 6px; }
#controls { display: flex; gap: 16px; align-items: center; flex-wrap: wrap; }
#legend { display: flex; align-items: center; gap: 6px; font-size: 12px; color: #555; }
#legend .bar { width: 160px; height: 12px; border: 1px solid #ccc; }
#runs { display: grid; gap: 12px; padding: 12px 16px; }
.run { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 10px 12px; min-width: 0; }
.run h2 { font-size: 15px; margin: 0 0 4px; word-break: break-all; }
.settings { font-size: 12px; color: #555; margin-bottom: 8px; }
.settings b { color: #222; font-weight: 600; }
.sample { margin: 8px 0; padding-top: 6px; border-top: 1px solid #eee; }
.shead { font-size: 12px; color: #555; margin-bottom: 3px; }
.prompt { font-family: ui-monospace, monospace; color: #888; }
.tok { font-family: ui-monospace, monospace; font-size: 15px; padding: 2px 2px; margin: 0 1px; border-radius: 3px;
       border: 1px solid transparent; cursor: pointer; white-space: pre; display: inline-block; }
.tok.over { border-color: #000; }
.tok.sel { outline: 2px solid #06c; }
.detail { display: grid; grid-template-columns: repeat(4, auto); gap: 1px 10px; justify-content: start;
          font-size: 12px; background: #f4f7fb; border: 1px solid #dde4ee; border-radius: 4px; padding: 6px 8px;
          margin-bottom: 4px; min-height: 16px; }
.detail .k { color: #666; } .detail .v { font-family: ui-monospace, monospace; }
"""

SCRIPT = r"""
const DATA = JSON.parse(document.getElementById('data').textContent);
const Q = {
  kl: {label: 'KL(p || q) before the projection', kind: 'seq',
       value: (s, t, run) => s.kl[t] === null ? null : s.kl[t] / run.eps,
       note: run => 'white 0 → red 2·eps; black frame: KL > eps'},
  projected: {label: 'projected (KL > eps)', kind: 'flag', value: (s, t) => s.projected[t],
              note: () => 'orange: projected'},
  dp: {label: 'probability change, log(p after / q)', kind: 'div',
       value: (s, t) => (s.p_after[t] && s.q[t]) ? Math.log(s.p_after[t] / s.q[t]) : null,
       note: () => 'blue: fell, red: rose (saturates at 3x)'},
  ratio: {label: 'raw ratio p(y) / q(y)', kind: 'div', value: (s, t) => s.ratio[t] ? Math.log(s.ratio[t]) : null,
          note: () => 'blue < 1 < red (saturates at 3x)'},
  ratio_proj: {label: 'projected ratio pi*(y) / q(y)', kind: 'div',
               value: (s, t) => s.ratio_proj[t] ? Math.log(s.ratio_proj[t]) : null,
               note: () => 'blue < 1 < red (saturates at 3x)'},
  clipped: {label: 'cut by PPO-clip at the run\'s range', kind: 'clip', value: (s, t) => s.clipped[t],
            note: () => 'purple: PPO-clip would cut the gradient'},
};
function mix(a, b, f) { return 'rgb(' + a.map((x, i) => Math.round(x + (b[i] - x) * f)).join(',') + ')'; }
function colour(kind, v) {
  const white = [255, 255, 255];
  if (v === null || v === undefined) return 'rgb(230,230,230)';
  if (kind === 'seq') return mix(white, [215, 40, 40], Math.min(Math.max(v, 0) / 2, 1));
  if (kind === 'flag') return v ? 'rgb(245,150,40)' : 'rgb(238,238,238)';
  if (kind === 'clip') return v ? 'rgb(150,70,200)' : 'rgb(238,238,238)';
  const f = Math.min(Math.abs(v) / Math.log(3), 1);
  return v >= 0 ? mix(white, [215, 40, 40], f) : mix(white, [40, 90, 215], f);
}
function fmt(x) {
  if (x === null || x === undefined) return '–';
  let s = (+x).toPrecision(4);
  if (s.includes('.')) s = s.replace(/0+(e|$)/, '$1').replace(/\.(e|$)/, '$1');
  return s;
}
function figures(run, s, t) {
  return [['token', JSON.stringify(s.text[t])], ['run', run.name], ['step', run.step], ['sample', s.index],
          ['advantage', fmt(s.adv)], ['q(y) old policy', fmt(s.q[t])], ['p(y) before the update', fmt(s.p[t])],
          ['p(y) after the update', fmt(s.p_after[t])], ['KL(p || q) before projection', fmt(s.kl[t])],
          ['eps', run.eps], ['projected', s.projected[t] ? 'yes' : 'no'], ['ratio p/q', fmt(s.ratio[t])],
          ['projected ratio pi*/q', fmt(s.ratio_proj[t])],
          ['PPO-clip (' + run.clip_low + '/' + run.clip_high + ') cuts it', s.clipped[t] ? 'yes' : 'no']];
}
function show(run, s, t, el) {  // the token's figures in its run's box
  const sec = el.closest('.run');
  sec.querySelectorAll('.tok.sel').forEach(e => e.classList.remove('sel'));
  el.classList.add('sel');
  const box = sec.querySelector('.detail');
  box.textContent = '';
  figures(run, s, t).filter(([k]) => k !== 'run' && k !== 'step').forEach(([k, v]) => {
    const a = document.createElement('span'); a.className = 'k'; a.textContent = k;
    const b = document.createElement('span'); b.className = 'v'; b.textContent = v;
    box.appendChild(a); box.appendChild(b);
  });
}
function render() {
  const main = document.getElementById('runs');
  main.style.gridTemplateColumns = 'repeat(' + DATA.runs.length + ', minmax(0, 1fr))';
  DATA.runs.forEach((run, r) => {
    const sec = document.createElement('section');
    sec.className = 'run'; sec.dataset.run = r; sec.dataset.loss = run.loss;
    const h = document.createElement('h2');
    h.textContent = run.name + ' — ' + run.loss + ', step ' + run.step;
    sec.appendChild(h);
    const st = document.createElement('div'); st.className = 'settings';
    Object.entries(run.settings).forEach(([k, v], i) => {
      if (i) st.appendChild(document.createTextNode(' · '));
      st.appendChild(document.createTextNode(k + ' ')); const b = document.createElement('b');
      b.textContent = v; st.appendChild(b);
    });
    sec.appendChild(st);
    const box = document.createElement('div'); box.className = 'detail';
    box.textContent = 'click a token for its figures'; sec.appendChild(box);
    run.samples.forEach(s => {
      const div = document.createElement('div'); div.className = 'sample'; div.dataset.index = s.index;
      const head = document.createElement('div'); head.className = 'shead';
      head.textContent = 'sample ' + s.index + ' · advantage ' + fmt(s.adv) + ' · reward ' + fmt(s.reward) + ' · ';
      const pr = document.createElement('span'); pr.className = 'prompt'; pr.textContent = s.prompt;
      head.appendChild(pr); div.appendChild(head);
      s.text.forEach((text, t) => {
        const span = document.createElement('span'); span.className = 'tok';
        span.textContent = text.replace(/ /g, '\u2423').replace(/\n/g, '\u23ce') || '\u2205';
        span.dataset.t = t; span.dataset.projected = s.projected[t]; span.dataset.clipped = s.clipped[t];
        span.title = figures(run, s, t).map(([k, v]) => k + ': ' + v).join('\n');
        span.addEventListener('click', () => show(run, s, t, span));
        span._v = [run, s, t];
        div.appendChild(span);
      });
      sec.appendChild(div);
    });
    main.appendChild(sec);
  });
}
function paint() {
  const key = document.getElementById('colour').value, q = Q[key];
  document.body.dataset.colour = key;
  document.querySelectorAll('.tok').forEach(span => {
    const [run, s, t] = span._v;
    span.style.backgroundColor = colour(q.kind, q.value(s, t, run));
    span.classList.toggle('over', key === 'kl' && s.projected[t] === 1);
  });
  const bar = document.querySelector('#legend .bar');
  const stops = q.kind === 'div' ? [-1.1, 0, 1.1] : q.kind === 'seq' ? [0, 2] : [0, 1];
  bar.style.background = 'linear-gradient(to right, ' + stops.map(v => colour(q.kind, v)).join(', ') + ')';
  document.getElementById('note').textContent = q.note(DATA.runs[0]);
}
const sel = document.getElementById('colour');
Object.entries(Q).forEach(([k, q]) => {
  const o = document.createElement('option'); o.value = k; o.textContent = q.label; sel.appendChild(o);
});
sel.value = DATA.colour;
sel.addEventListener('change', paint);
render();
paint();
// #pin=RUN.SAMPLE.TOKEN[,RUN.SAMPLE.TOKEN]: those tokens' figures shown, as if clicked
location.hash.replace(/^#pin=/, '').split(',').forEach(p => {
  const pin = /^(\d+)\.(\d+)\.(\d+)$/.exec(p), sec = pin && document.querySelectorAll('.run')[+pin[1]];
  const span = sec && sec.querySelector('.sample[data-index="' + pin[2] + '"] .tok[data-t="' + pin[3] + '"]');
  if (span) show(span._v[0], span._v[1], span._v[2], span);
});
document.body.dataset.ready = '1';
"""

# JSON inside a script element: no "<" (so no "</script>", "<!--" or "<script"), ">" or "&" for the HTML parser to
# read, no U+2028 / U+2029 for an older script parser; each written as the JSON escape that parses back to it
SCRIPT_SAFE = str.maketrans({c: f"\\u{ord(c):04x}" for c in "<>&\u2028\u2029"})

QUANTITIES = ("kl", "projected", "dp", "ratio", "ratio_proj", "clipped")


def page(runs: list[tuple[str, dict, dict]], colour: str = "kl") -> str:
    """The HTML page of the given (name, config, row) triples: every byte inline, no URL in it."""
    data = {
        "colour": colour,
        "runs": [
            {"name": name, "settings": {k: cfg[k] for k in SHOWN if k in cfg}, **row} for name, cfg, row in runs
        ],
    }
    blob = json.dumps(data, separators=(",", ":"), allow_nan=False).translate(SCRIPT_SAFE)
    title = html.escape(" | ".join(f"{name} step {row['step']}" for name, _, row in runs))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>troll.inspect: {title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{STYLE}</style></head>
<body>
<header><h1>The trust region, token by token</h1>
<div id="controls"><label>Colour by <select id="colour"></select></label>
<span id="legend"><span class="bar"></span><span id="note"></span></span>
<span style="font-size:12px;color:#555">hover a token for its figures, click to pin them</span></div></header>
<main id="runs"></main>
<script type="application/json" id="data">{blob}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="one run directory, or two to see side by side")
    parser.add_argument("--step", type=int, default=None, help="the recorded step to show (default: the last one "
                        "every run recorded)")  # fmt: skip
    parser.add_argument("--out", default=None, help="write the HTML page here (self-contained; opens from disk)")
    parser.add_argument("--colour", default="kl", choices=QUANTITIES, help="the page's colouring when it opens")
    args = parser.parse_args(argv)
    if len(args.runs) > 2:
        parser.error(f"at most two runs side by side, got {len(args.runs)}")
    page_file = None if args.out is None else outputs.named(Path(args.out).expanduser(), "--out")
    if page_file is not None:
        outputs.check([page_file])  # a folder or a link there, or a file where its folder belongs: one line
        if not page_file.path.parent.is_dir():
            raise UsageError(f"--out {args.out}: its folder does not exist: create it, or choose another path")
    loaded = [(run, *load(run)) for run in args.runs]
    step = pick_step(loaded, args.step)
    shown = [(name, cfg, at_step(rows, step)) for name, cfg, rows in loaded]
    for name, cfg, row in shown:
        print(text_summary(name, cfg, row))
    if page_file is not None:
        try:
            outputs.write(page_file, page(shown, args.colour))
        except OSError as e:
            raise UsageError(f"--out {args.out} cannot be written ({e.strerror}): choose another path") from None
        print(f"page: {args.out}")


if __name__ == "__main__":
    run_command(PROG, main)
