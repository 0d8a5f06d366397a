"""See the trust region act, token by token: a run's per-token records (troll.run.records) as a page and as text.

    troll inspect runs/tiny-rare-troll runs/tiny-rare-ppo --step 15 --out page.html

prints, for each run, the step's recorded samples token by token (q, p before, at and after the update, the KL at
the token's position before the projection, projected or not, the raw and the projected ratio, and whether PPO-clip
cuts the token), and with `--out` writes one self-contained HTML page: inline CSS and script, nothing fetched, it
opens from disk; its data is JSON with every `<`, `>`, `&`, U+2028 and U+2029 escaped, so no text it shows can end or
stop its script.

The page shows each completion as its tokens, two runs side by side, coloured by the view chosen at its top:

    update      the update's own change, log(p after / p before): red rose, blue fell (the default; p before:
                the network before the step's update)
    clip_ball   the clip against the ball: the clip cuts and the ball lets through; both act; only the ball; neither
    drift       drift from the old policy q (the sampler, or the recomputed network), log(p after / q)
    kl          KL(p || q) in nats at the token's position, before the projection (framed where it is above eps)
    ratio       the raw ratio p / q;  ratio_proj  the projected ratio pi* / q

with a three-line key (q, p, pi*, the KL's unit and scope), each panel's counts (tokens, projected, cut) and the
run's held-out accuracy at the step (metrics.jsonl), which samples both panels share, and every recorded step
behind a step selector (at most MAX_STEPS a run, evenly spaced, the first, shown and last kept: the page is at most
about runs x MAX_STEPS x troll.run.records.row_bytes_bound bytes, and the command prints its size). A click pins a
token's figures: what happened, and set apart, what the other method would have done (a TROLL run's clip, a
PPO-clip run's projection, both under DPPO and CISPO: troll.run.records computes them for every run). The address
`page.html#colour=clip_ball&step=15&pin=RUN.SAMPLE.TOKEN,...` opens on that view and step with those tokens pinned
(`pin=1.239.3`: the second run, sample 239, its fourth token); a value that names none of the page's own views
(`constructor`, which every object inherits, is none) or is no recorded step in decimal digits (`1e0` is not) opens
the default view or step. Each sample shows its whole prompt and its gold answer (tokens.jsonl version 3).

The page replaces a file at `--out` as a tool's `-o` does, whole (a temporary file beside it, renamed over it:
troll.base.outputs); a folder or a symbolic link there is refused, the link left as it is and never written through.
`--step` picks the step shown first (default: the last one every run recorded), `--colour` the view. A run's records
are read whole only at the steps the page holds (troll.run.records.Records: a 30,000-step file opens in a second). A
missing or damaged run file (config.json; each records row read, checked field by field against troll.run.records'
schema; metrics.jsonl against troll.run.runfiles') is one line naming it, and for a row its line and field
(`troll.base.cli.run_command`), never a traceback.
"""

from __future__ import annotations

import html
import json
import warnings
from pathlib import Path

from troll.base import outputs
from troll.base.cli import Parser, UsageError, run_command
from troll.run.records import Records, ratio

PROG = "troll inspect"
SHOWN = ("task", "loss", "eps", "clip_low", "clip_high", "level", "support", "old_policy", "staleness", "lr",
         "prompts_per_step", "samples_per_prompt", "epochs", "minibatches", "seed", "steps")  # fmt: skip
TEXT_TOKENS = 24  # the terminal shows at most this many tokens of a sample (the page shows all)
MAX_STEPS = 40  # recorded steps a run puts in the page, at most
ACTS = {"troll": "ball", "ppo_clip": "clip"}  # which of the two a run's loss applies; the other is hypothetical


def load(run: str) -> tuple[dict, Records, dict[int, float]]:
    """A run's config (as saved), its per-token records (indexed by step, a row read whole when asked for:
    troll.run.records.Records) and its held-out accuracy by step (empty without metrics.jsonl); UsageError naming what
    is missing or damaged."""
    from troll.run.runfiles import read_metrics

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
    rows = Records(out)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a torn last line: skipped, as resume drops it
            evals = {r["step"]: r["eval_acc"] for r in read_metrics(out) if r.get("eval_acc") is not None}
    except FileNotFoundError:
        if (out / "metrics.jsonl").exists():  # a folder, say: not a file the run wrote
            raise UsageError(f"{out / 'metrics.jsonl'} is not a file: move it away (the run writes its metrics "
                             "there)") from None  # fmt: skip
        evals = {}  # the page says no evaluation is on record
    except ValueError as e:  # read_metrics' SchemaError, or a line that is not JSON: it names the file and line
        raise UsageError(str(e)) from None
    except OSError as e:
        raise UsageError(f"{out / 'metrics.jsonl'} cannot be read ({e.strerror or e}): restore it") from None
    return cfg, rows, evals


def _not_json(name: str) -> None:
    """json.loads' hook for NaN and Infinity: no JSON value (JSON.parse refuses them), and troll never writes them."""
    raise ValueError(f"{name} is not JSON")


def pick_step(have: dict[str, list[int]], step: int | None) -> int:
    """The step to show: `step`, which every run (name -> its recorded steps) must have recorded, or the last step
    all of them recorded."""
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
    """The first row at `step`."""
    return next(r for r in rows if r["step"] == step)


def kept_rows(rows: list[dict], step: int) -> list[dict]:
    """The rows at the steps kept_steps keeps (the steps listed once, not once a row)."""
    kept = set(kept_steps([r["step"] for r in rows], step))
    return [r for r in rows if r["step"] in kept]


def shown(recs: Records, step: int) -> list[dict]:
    """The rows of a run the page holds when it opens at `step` (kept_steps), read whole."""
    return recs.rows(set(kept_steps(recs.steps, step)))


def accuracy_at(evals: dict[int, float], step: int) -> tuple[int, float] | None:
    """The run's last held-out evaluation at or before `step` (its step, its accuracy), or None."""
    done = [s for s in evals if s <= step]
    return (max(done), evals[max(done)]) if done else None


def kept_steps(steps: list[int], shown: int, limit: int = MAX_STEPS) -> list[int]:
    """At most `limit` of a run's recorded steps, evenly spaced, the first, the last and `shown` always kept."""
    if len(steps) <= limit:
        return steps
    picked = {steps[round(i * (len(steps) - 1) / (limit - 2))] for i in range(limit - 1)} | {shown}
    return sorted(picked)


# ----------------------------------------------------------------------------- text


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _ratio(log_ratio: float | None) -> float | None:
    return None if log_ratio is None else ratio(log_ratio)


def counts(loss: str, row: dict) -> str:
    """A panel's counts: tokens, projected, cut; what the run's loss did not do is marked "would be"."""
    toks = [(s, t) for s in row["samples"] for t in range(len(s["text"]))]
    projected = sum(s["projected"][t] for s, t in toks)
    clipped = sum(s["clipped"][t] for s, t in toks)
    acts = ACTS.get(loss)
    return (f"{len(row['samples'])} samples, {len(toks)} tokens, {projected} "
            f"{'projected' if acts == 'ball' else 'would be projected'} (KL > eps), {clipped} "
            f"{'cut by the clip' if acts == 'clip' else 'PPO-clip would cut'}")  # fmt: skip


def text_summary(name: str, cfg: dict, row: dict, evals: dict[int, float] | None = None) -> str:
    """The step's records of one run as plain text: a head line, then each sample's tokens."""
    loss = cfg.get("loss", row["loss"])
    acc = accuracy_at(evals or {}, row["step"])
    accuracy = f"; held-out accuracy {acc[1]:.3f} at step {acc[0]}" if acc else ""
    lines = [
        f"{name}: {loss} at step {row['step']} (eps {row['eps']}, clip range {row['clip_low']}/{row['clip_high']}): "
        f"{counts(loss, row)}{accuracy}",
        f"  {'token':>12} {'q':>9} {'p before':>9} {'p':>9} {'p after':>9} {'KL':>9} {'proj':>4} {'ratio':>7} "
        f"{'ratio*':>7} clip",
    ]
    for s in row["samples"]:
        gold = "" if s["gold"] is None else f", gold {s['gold']!r}"
        lines.append(f"  sample {s['index']}: advantage {_num(s['adv'])}, reward {_num(s['reward'])}{gold}, "
                     f"prompt {s['prompt'][-40:]!r}")  # fmt: skip
        for t, text in enumerate(s["text"][:TEXT_TOKENS]):
            lines.append(
                f"  {text[:12]!r:>12} {_num(s['q'][t]):>9} {_num(s['p_before'][t]):>9} {_num(s['p'][t]):>9} "
                f"{_num(s['p_after'][t]):>9} {_num(s['kl'][t]):>9} {'yes' if s['projected'][t] else '':>4} "
                f"{_num(_ratio(s['log_ratio'][t])):>7} {_num(_ratio(s['log_ratio_proj'][t])):>7} "
                f"{'cut' if s['clipped'][t] else ''}"
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
#legend { display: flex; align-items: center; gap: 10px; font-size: 12px; color: #444; }
#legend .sw { display: inline-flex; align-items: center; gap: 4px; }
#legend .chip { width: 14px; height: 12px; border: 1px solid #bbb; display: inline-block; }
#key { font-size: 12px; color: #444; margin-top: 6px; line-height: 1.5; }
#runs { display: grid; gap: 12px; padding: 12px 16px; }
.run { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 10px 12px; min-width: 0; }
.run h2 { font-size: 15px; margin: 0 0 4px; word-break: break-all; }
.settings, .counts, .shared { font-size: 12px; color: #555; margin-bottom: 4px; }
.settings b, .counts b { color: #222; font-weight: 600; }
.sample { margin: 8px 0; padding-top: 6px; border-top: 1px solid #eee; }
.shead { font-size: 12px; color: #555; margin-bottom: 3px; }
.badge { background: #e8eefc; color: #234; border-radius: 3px; padding: 0 4px; margin-left: 4px; }
.prompt { font-family: ui-monospace, monospace; color: #888; white-space: pre-wrap; }
.gold { font-family: ui-monospace, monospace; color: #555; }
.tok { font-family: ui-monospace, monospace; font-size: 15px; padding: 2px 2px; margin: 0 1px; border-radius: 3px;
       border: 1px solid transparent; cursor: pointer; white-space: pre; display: inline-block; }
.tok.over { border-color: #000; }
.tok.sel { outline: 2px solid #06c; }
.detail { display: grid; grid-template-columns: repeat(4, auto); gap: 1px 10px; justify-content: start;
          font-size: 12px; background: #f4f7fb; border: 1px solid #dde4ee; border-radius: 4px; padding: 6px 8px;
          margin-bottom: 4px; min-height: 16px; }
.detail .k { color: #666; } .detail .v { font-family: ui-monospace, monospace; }
.detail .h { grid-column: 1 / -1; font-weight: 600; color: #333; margin-top: 2px; }
.detail .hyp { color: #888; font-style: italic; }
"""

SCRIPT = r"""
const DATA = JSON.parse(document.getElementById('data').textContent);
const RED = [215, 40, 40], BLUE = [40, 90, 215], GREY = [238, 238, 238], NONE = [230, 230, 230];
const lg = (a, b) => (a && b) ? Math.log(a / b) : null;
// the four cases of the clip against the ball, in the legend's order
const CASES = [['the clip cuts, the ball lets through', [150, 70, 200]], ['both act', [200, 30, 30]],
               ['only the ball', [245, 150, 40]], ['neither', GREY]];
const Q = {
  update: {label: "the update's change, log(p after / p before)", kind: 'div', scale: Math.log(1.3),
           value: (s, t) => lg(s.p_after[t], s.p_before[t]), ends: ['fell', 'rose'], note: 'saturates at 1.3x'},
  clip_ball: {label: 'the clip against the ball', kind: 'cases',
              value: (s, t) => s.clipped[t] ? (s.projected[t] ? 1 : 0) : (s.projected[t] ? 2 : 3)},
  drift: {label: 'drift from the old policy q, log(p after / q)', kind: 'div', scale: Math.log(3),
          value: (s, t) => lg(s.p_after[t], s.q[t]), ends: ['below q', 'above q'], note: 'saturates at 3x'},
  kl: {label: 'KL(p || q) at the position, before the projection', kind: 'seq',
       value: (s, t, run) => s.kl[t] === null ? null : s.kl[t] / run.eps, ends: ['0', '2·eps'],
       note: 'black frame: KL > eps (projected)'},
  ratio: {label: 'raw ratio p / q', kind: 'div', scale: Math.log(3), value: (s, t) => s.log_ratio[t],
          ends: ['below 1', 'above 1'], note: 'saturates at 3x'},
  ratio_proj: {label: 'projected ratio π* / q', kind: 'div', scale: Math.log(3),
               value: (s, t) => s.log_ratio_proj[t], ends: ['below 1', 'above 1'], note: 'saturates at 3x'},
};
function rgb(c) { return 'rgb(' + c.map(Math.round).join(',') + ')'; }
function mix(a, b, f) { return a.map((x, i) => x + (b[i] - x) * f); }
function colour(q, v) {
  if (v === null || v === undefined) return rgb(NONE);
  if (q.kind === 'cases') return rgb(CASES[v][1]);
  if (q.kind === 'seq') return rgb(mix([255, 255, 255], RED, Math.min(Math.max(v, 0) / 2, 1)));
  return rgb(mix([255, 255, 255], v >= 0 ? RED : BLUE, Math.min(Math.abs(v) / q.scale, 1)));
}
function fmt(x) {
  if (x === null || x === undefined) return '–';
  let s = (+x).toPrecision(4);
  if (s.includes('.')) s = s.replace(/0+(e|$)/, '$1').replace(/\.(e|$)/, '$1');
  return s;
}
const acts = run => DATA.acts[run.loss] || null;  // which of the two the run's loss applies (ACTS)
function figures(run, s, t) {  // [[heading], [key, value, hypothetical], ...]
  const e = v => v === null ? null : Math.exp(v), a = acts(run);
  const ball = [['projected (KL > eps)', s.projected[t] ? 'yes' : 'no'],
                ['projected ratio π*/q', fmt(e(s.log_ratio_proj[t]))]];
  const clip = [['PPO-clip (' + run.clip_low + '/' + run.clip_high + ') cuts it', s.clipped[t] ? 'yes' : 'no']];
  const lr = s.log_ratio.filter(x => x !== null);
  const seq = run.level === 'sequence' && lr.length ?
    [['sequence ratio − 1, exp(mean log p/q) − 1', Math.expm1(lr.reduce((u, v) => u + v, 0) / lr.length)
      .toPrecision(6)]] : [];
  const other = a === 'ball' ? clip : a === 'clip' ? ball : ball.concat(clip);
  return [['what happened'], ['token', JSON.stringify(s.text[t])], ['sample', s.index],
          ['advantage', fmt(s.adv)], ['q(y) old policy', fmt(s.q[t])], ['p(y) before the update', fmt(s.p_before[t])],
          ['p(y) at its training pass', fmt(s.p[t])], ['p(y) after the update', fmt(s.p_after[t])],
          ['KL(p || q) at the position, nats', fmt(s.kl[t])], ['eps', run.eps], ['ratio p/q', fmt(e(s.log_ratio[t]))],
          ...seq, ...(a === 'ball' ? ball : a === 'clip' ? clip : []),
          ['hypothetical: what ' + (a === 'ball' ? 'PPO-clip' : a === 'clip' ? 'TROLL' : 'TROLL and PPO-clip') +
           ' would have done'], ...other.map(([k, v]) => [k, v, true])];
}
function show(run, s, t, el) {  // the token's figures in its run's box
  const sec = el.closest('.run');
  sec.querySelectorAll('.tok.sel').forEach(e => e.classList.remove('sel'));
  el.classList.add('sel');
  const box = sec.querySelector('.detail');
  box.textContent = '';
  figures(run, s, t).forEach(([k, v, hyp]) => {
    if (v === undefined) {
      const h = document.createElement('span'); h.className = 'h'; h.textContent = k; box.appendChild(h); return;
    }
    const a = document.createElement('span'); a.className = 'k' + (hyp ? ' hyp' : ''); a.textContent = k;
    const b = document.createElement('span'); b.className = 'v' + (hyp ? ' hyp' : ''); b.textContent = v;
    box.appendChild(a); box.appendChild(b);
  });
}
function el(tag, cls, text) {
  const e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text;
  return e;
}
function rowOf(run, step) { return run.rows.find(r => r.step === step); }
function sharing(row, other) {  // sample index -> 'same completion' or 'same prompt', for samples the other shows
  const out = {};
  if (!row || !other) return out;
  row.samples.forEach(s => {
    const o = other.samples.find(x => x.index === s.index);
    if (o && o.prompt === s.prompt) out[s.index] = o.text.join('') === s.text.join('') ? 'same completion'
                                                                                       : 'same prompt';
  });
  return out;
}
function render(step) {
  const main = document.getElementById('runs');
  main.textContent = '';
  main.style.gridTemplateColumns = 'repeat(' + DATA.runs.length + ', minmax(0, 1fr))';
  DATA.runs.forEach((run, r) => {
    const row = rowOf(run, step), other = DATA.runs[1 - r], a = acts(run);
    const sec = el('section', 'run'); sec.dataset.run = r; sec.dataset.loss = run.loss;
    sec.appendChild(el('h2', null, run.name + ' — ' + run.loss + ', step ' + step));
    const st = el('div', 'settings');
    Object.entries(run.settings).forEach(([k, v], i) => {
      if (i) st.appendChild(document.createTextNode(' · '));
      st.appendChild(document.createTextNode(k + ' ')); st.appendChild(el('b', null, String(v)));
    });
    sec.appendChild(st);
    const acc = Object.keys(run.evals).map(Number).filter(x => x <= step);
    const accText = acc.length ? 'held-out accuracy ' + fmt(run.evals[Math.max(...acc)]) + ' (evaluated at step ' +
                                 Math.max(...acc) + ')' : 'no evaluation by this step';
    if (!row) {
      sec.appendChild(el('div', 'counts', 'no records at step ' + step + ' · ' + accText));
      main.appendChild(sec); return;
    }
    const toks = row.samples.reduce((n, s) => n + s.text.length, 0);
    const sum = k => row.samples.reduce((n, s) => n + s[k].reduce((u, v) => u + v, 0), 0);
    const c = el('div', 'counts');
    c.textContent = toks + ' tokens in ' + row.samples.length + ' samples · ' + sum('projected') +
      (a === 'ball' ? ' projected' : ' would be projected (hypothetical)') + ' · ' + sum('clipped') +
      (a === 'clip' ? ' cut by the clip' : ' PPO-clip would cut (hypothetical)') + ' · ' + accText;
    sec.appendChild(c);
    const shared = sharing(row, other && rowOf(other, step));
    if (other) {
      const list = Object.entries(shared).map(([i, how]) => i + ' (' + how + ')');
      sec.appendChild(el('div', 'shared', 'samples the other panel shows too: ' + (list.join(', ') || 'none')));
    }
    const box = el('div', 'detail', 'click a token for its figures'); sec.appendChild(box);
    row.samples.forEach(s => {
      const div = el('div', 'sample'); div.dataset.index = s.index;
      const head = el('div', 'shead', 'sample ' + s.index + ' · advantage ' + fmt(s.adv) + ' · reward ' +
                      fmt(s.reward) + ' · ');
      head.appendChild(el('span', 'prompt', s.prompt));
      if (s.gold !== null) head.appendChild(el('span', 'gold', ' · gold ' + JSON.stringify(s.gold)));
      if (shared[s.index]) head.appendChild(el('span', 'badge', 'in both panels: ' + shared[s.index]));
      div.appendChild(head);
      s.text.forEach((text, t) => {
        const span = el('span', 'tok', text.replace(/ /g, '\u2423').replace(/\n/g, '\u23ce') || '\u2205');
        span.dataset.t = t; span.dataset.projected = s.projected[t]; span.dataset.clipped = s.clipped[t];
        span.title = figures(run, s, t).map(([k, v]) => v === undefined ? '— ' + k + ' —' : k + ': ' + v).join('\n');
        span.addEventListener('click', () => show(run, s, t, span));
        span._v = [run, s, t];
        div.appendChild(span);
      });
      sec.appendChild(div);
    });
    main.appendChild(sec);
  });
  document.body.dataset.step = step;
}
function paint() {
  const key = document.getElementById('colour').value, q = Q[key];
  document.body.dataset.colour = key;
  document.querySelectorAll('.tok').forEach(span => {
    const [run, s, t] = span._v;
    span.style.backgroundColor = colour(q, q.value(s, t, run));
    span.classList.toggle('over', key === 'kl' && s.projected[t] === 1);
  });
  const legend = document.getElementById('legend');
  legend.textContent = '';
  const chips = q.kind === 'cases' ? CASES.map(([label, c]) => [label, rgb(c)]) :
    q.kind === 'seq' ? [[q.ends[0], colour(q, 0)], [q.ends[1], colour(q, 2)]] :
    [[q.ends[0], colour(q, -q.scale)], [q.ends[1], colour(q, q.scale)]];
  chips.forEach(([label, c]) => {
    const sw = el('span', 'sw'); const chip = el('span', 'chip'); chip.style.backgroundColor = c;
    sw.appendChild(chip); sw.appendChild(document.createTextNode(label)); legend.appendChild(sw);
  });
  if (q.note) legend.appendChild(el('span', 'note', '(' + q.note + ')'));
}
// the address: #colour=VIEW&step=STEP&pin=RUN.SAMPLE.TOKEN,... (each part optional). Its values are looked up
// among the page's own: a view among Q's own keys (not `constructor`, which every object inherits), a step or an
// index written in decimal digits (`01` is 1; `1e0`, ` 1`, `1.0` are not numbers here) and exact (2**53 - 1 at most,
// as the records' schema bounds them); anything else is left for the default view and step
const HASH = new URLSearchParams(location.hash.replace(/^#/, ''));
const own = (obj, key) => key !== null && Object.prototype.hasOwnProperty.call(obj, key);
const whole = v => /^[0-9]+$/.test(v) && Number.isSafeInteger(+v) ? +v : null;  // a decimal integer, or null
function pin(p) {  // RUN.SAMPLE.TOKEN: that token's figures shown, as if clicked
  const parts = p.split('.').map(whole);
  if (parts.length !== 3 || parts.includes(null)) return;
  const [r, i, t] = parts, sec = document.querySelectorAll('.run')[r];
  const span = sec && sec.querySelector('.sample[data-index="' + i + '"] .tok[data-t="' + t + '"]');
  if (span) show(span._v[0], span._v[1], span._v[2], span);
}
const sel = document.getElementById('colour'), steps = document.getElementById('step');
Object.entries(Q).forEach(([k, q]) => sel.appendChild(Object.assign(el('option', null, q.label), {value: k})));
const ALL = [...new Set(DATA.runs.flatMap(run => run.rows.map(r => r.step)))].sort((a, b) => a - b);
ALL.forEach(s => steps.appendChild(Object.assign(el('option', null, String(s)), {value: String(s)})));
const asked = whole(HASH.get('step') || '');
sel.value = own(Q, HASH.get('colour')) ? HASH.get('colour') : DATA.colour;
steps.value = String(ALL.includes(asked) ? asked : DATA.step);
sel.addEventListener('change', paint);
steps.addEventListener('change', () => { render(+steps.value); paint(); });
render(+steps.value);
paint();
(HASH.get('pin') || '').split(',').forEach(pin);
document.body.dataset.ready = '1';
"""

KEY = (
    "<b>q</b>: the old policy the trust region is anchored to (the sampler, or the network recomputed on its "
    "samples) · <b>p</b>: the network, before the update, at the pass that trained the sample, and after it",
    "<b>π*</b>: p projected onto the ball KL(π || q) ≤ eps, what TROLL trains toward · PPO-clip instead cuts a "
    "token's gradient once p/q leaves [1 − clip_low, 1 + clip_high] in the advantage's direction",
    "<b>KL</b> is in nats, of the whole next-token distribution at the token's position (every candidate on the "
    "run's sparse support), not of the token alone · a panel's hypothetical figures: what the other method would "
    "have done",
)

# JSON inside a script element: no "<" (so no "</script>", "<!--" or "<script"), ">" or "&" for the HTML parser to
# read, no U+2028 / U+2029 for an older script parser; each written as the JSON escape that parses back to it
SCRIPT_SAFE = str.maketrans({c: f"\\u{ord(c):04x}" for c in "<>&\u2028\u2029"})

QUANTITIES = ("update", "clip_ball", "drift", "kl", "ratio", "ratio_proj")


def page(runs: list[tuple[str, dict, list[dict], dict[int, float]]], step: int, colour: str = "update") -> str:
    """The HTML page of the given (name, config, records rows, accuracy by step) runs, opening at `step`: every byte
    inline, no URL in it."""
    data = {
        "colour": colour,
        "step": step,
        "acts": ACTS,
        "runs": [
            {"name": name, "settings": {k: cfg[k] for k in SHOWN if k in cfg}, "loss": cfg.get("loss", rows[0]["loss"]),
             "eps": rows[0]["eps"], "clip_low": rows[0]["clip_low"], "clip_high": rows[0]["clip_high"],
             "level": rows[0]["level"], "evals": evals,
             "rows": kept_rows(rows, step)}
            for name, cfg, rows, evals in runs
        ],
    }  # fmt: skip
    blob = json.dumps(data, separators=(",", ":"), allow_nan=False).translate(SCRIPT_SAFE)
    title = html.escape(" | ".join(name for name, *_ in runs))
    key = "".join(f"<div>{line}</div>" for line in KEY)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>troll.tools.inspect: {title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{STYLE}</style></head>
<body>
<header><h1>The trust region, token by token</h1>
<div id="controls"><label>Colour by <select id="colour"></select></label>
<label>step <select id="step"></select></label>
<span id="legend"></span>
<span style="font-size:12px;color:#555">hover a token for its figures, click to pin them</span></div>
<div id="key">{key}</div></header>
<main id="runs"></main>
<script type="application/json" id="data">{blob}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="one run directory, or two to see side by side")
    parser.add_argument("--step", type=int, default=None, help="the recorded step to show first (default: the last "
                        "one every run recorded)")  # fmt: skip
    parser.add_argument("--out", default=None, help="write the HTML page here (self-contained; opens from disk)")
    parser.add_argument("--colour", default="update", choices=QUANTITIES, help="the page's view when it opens "
                        "(default: update, the update's own change)")  # fmt: skip
    args = parser.parse_args(argv)
    if len(args.runs) > 2:
        parser.error(f"at most two runs side by side, got {len(args.runs)}")
    page_file = None if args.out is None else outputs.named(Path(args.out).expanduser(), "--out")
    if page_file is not None:
        outputs.check([page_file])  # a folder or a link there, or a file where its folder belongs: one line
        if not page_file.path.parent.is_dir():
            raise UsageError(f"--out {args.out}: its folder does not exist: create it, or choose another path")
    loaded = [(run, *load(run)) for run in args.runs]
    step = pick_step({name: recs.steps for name, _, recs, _ in loaded}, args.step)
    loaded = [(name, cfg, shown(recs, step), evals) for name, cfg, recs, evals in loaded]  # each run's <= MAX_STEPS
    for name, cfg, rows, evals in loaded:
        print(text_summary(name, cfg, at_step(rows, step), evals))
    if page_file is not None:
        made = page(loaded, step, args.colour)
        try:
            outputs.write(page_file, made)
        except OSError as e:
            raise UsageError(f"--out {args.out} cannot be written ({e.strerror}): choose another path") from None
        print(f"page: {args.out} ({len(made.encode()) // 1024} KB; step {step} shown first, each run's recorded "
              f"steps behind the step selector)")


if __name__ == "__main__":
    run_command(PROG, main)
