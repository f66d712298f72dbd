"""Which target / drafter pairings speculation can pay for on a launch-bound GPU (``recsvc bench pairing``).

At batch 1 with CUDA graphs a request's time is the replays it launches, not its arithmetic: a decoder layer's
forward costs about the same whatever its width, and so does a head / selection graph. The launch model::

    ms per request = (target forwards * target layers + drafter forwards * drafter layers) * layer_ms
                     + graphs * graph_ms

Counts per request, ``levels`` = L codes per item id (4), every drafted depth accepted (the best case):
- plain beam search: L target forwards (the prompt's, then one per level) and L selection graphs;
- strict speculation: the prompt's forward and one verification (2 target forwards; 1 when the prompt is
  verified with the tree in one forward, which a LLaMA drafter allows and the draft head, drafting from the
  prompt's hidden state, does not), L - 1 drafter forwards (a LLaMA drafter's depths; the draft head has no
  decoder layer), and 1 + 2 (L - 1) graphs (the first selection, then per depth the draft's expansion and the
  replay's selection).
A measured ``--target-calls`` (``recsvc bench speculative`` reports it) replaces the best case's target forwards,
the rest kept, so its ratio is still a ceiling. The defaults of ``layer_ms`` / ``graph_ms`` are an H100's in bf16
(``make gpu-bench``: plain ``base`` in 8.0 ms = 48 layer-forwards + 4 graphs). ``ceiling`` is the ratio when the
graph overheads vanish too (layer-forwards alone). Estimates from counts, not timings: the GPU bench measures.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from recsvc.bundle.presets import DRAFTER_PRESETS, TARGET_PRESETS, get_preset
from recsvc.errors import UserError

HELP = "launch-model estimate of strict speculation's speed-up per target / drafter pairing (no model is run)"
LEVELS = 4
HEAD = "head"  # the draft head: drafts from the target's hidden state, no decoder layer of its own


@dataclass(frozen=True)
class LaunchCosts:
    layer_ms: float = 0.14  # one decoder layer's forward, replayed in a CUDA graph, batch 1
    graph_ms: float = 0.25  # one head / selection graph


@dataclass(frozen=True)
class RequestCounts:
    """Per request: target and drafter forwards, and graphs that are not forwards."""

    target_forwards: float
    drafter_forwards: float
    graphs: float

    def layer_forwards(self, target_layers: int, drafter_layers: int) -> float:
        return self.target_forwards * target_layers + self.drafter_forwards * drafter_layers

    def ms(self, target_layers: int, drafter_layers: int, costs: LaunchCosts) -> float:
        return self.layer_forwards(target_layers, drafter_layers) * costs.layer_ms + self.graphs * costs.graph_ms


def plain_counts(levels: int = LEVELS) -> RequestCounts:
    return RequestCounts(target_forwards=levels, drafter_forwards=0, graphs=levels)


def strict_counts(drafter: str, levels: int = LEVELS, prompt_in_verify: bool = False,
                  target_calls: float | None = None) -> RequestCounts:
    """Best case (every depth accepted) unless ``target_calls`` (measured) is given."""
    depths = levels - 1
    one_pass = prompt_in_verify and drafter != HEAD
    target = target_calls if target_calls is not None else (1 if one_pass else 2)
    return RequestCounts(target_forwards=target, drafter_forwards=0 if drafter == HEAD else depths,
                         graphs=1 + 2 * depths)


@dataclass(frozen=True)
class PairingEstimate:
    target: str
    drafter: str
    prompt_in_verify: bool
    plain_layer_forwards: float
    strict_layer_forwards: float
    plain_ms: float
    strict_ms: float
    speedup: float  # plain_ms / strict_ms
    ceiling: float  # plain / strict layer-forwards: the speed-up when graph overheads vanish


def estimate(target: str, drafter: str, costs: LaunchCosts = LaunchCosts(), levels: int = LEVELS,
             prompt_in_verify: bool = False, target_calls: float | None = None) -> PairingEstimate:
    """The launch model's plain and strict ms per request for ``target`` (a target preset) and ``drafter``
    (a drafter preset or "head")."""
    t_layers = get_preset(target).layers
    d_layers = 0 if drafter == HEAD else get_preset(drafter).layers
    plain, strict = plain_counts(levels), strict_counts(drafter, levels, prompt_in_verify, target_calls)
    p_lf, s_lf = plain.layer_forwards(t_layers, 0), strict.layer_forwards(t_layers, d_layers)
    p_ms, s_ms = plain.ms(t_layers, 0, costs), strict.ms(t_layers, d_layers, costs)
    return PairingEstimate(target, drafter, prompt_in_verify and drafter != HEAD, p_lf, s_lf, round(p_ms, 3),
                           round(s_ms, 3), round(p_ms / s_ms, 3), round(p_lf / s_lf, 3))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", default="small,base", help=f"target presets ({', '.join(TARGET_PRESETS)})")
    p.add_argument("--drafters", default=f"{HEAD},llama-68m",
                   help=f"drafters: {HEAD} or a drafter preset ({', '.join(DRAFTER_PRESETS)})")
    p.add_argument("--layer-ms", type=float, default=LaunchCosts.layer_ms, help="ms per replayed layer-forward")
    p.add_argument("--graph-ms", type=float, default=LaunchCosts.graph_ms, help="ms per head / selection graph")
    p.add_argument("--target-calls", type=float, default=None,
                   help="measured target forwards per strict request (default: the best case)")
    p.add_argument("--json", default=None, help="also write the rows here")


def _names(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise UserError(f"--{what}: unknown {', '.join(bad) or '(none given)'}; expected {', '.join(allowed)}")
    return names


def run(args: argparse.Namespace) -> None:
    targets = _names(args.targets, TARGET_PRESETS, "targets")
    drafters = _names(args.drafters, (HEAD, *DRAFTER_PRESETS), "drafters")
    if args.layer_ms <= 0 or args.graph_ms < 0:
        raise UserError("--layer-ms must be > 0 and --graph-ms >= 0")
    if args.target_calls is not None and not 1 <= args.target_calls <= LEVELS:
        raise UserError(f"--target-calls must lie in [1, {LEVELS}]")
    costs = LaunchCosts(args.layer_ms, args.graph_ms)
    rows = [estimate(t, d, costs, prompt_in_verify=one, target_calls=args.target_calls)
            for t in targets for d in drafters
            for one in ((False, True) if d != HEAD and args.target_calls is None else (False,))]
    print(f"launch model: {costs.layer_ms} ms per layer-forward, {costs.graph_ms} ms per graph, {LEVELS} levels, "
          + ("every depth accepted" if args.target_calls is None else f"{args.target_calls} target calls"))
    print("| target | drafter | prompt in verification | layer-forwards plain / strict | ms plain / strict | "
          "speed-up | ceiling |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r.target} | {r.drafter} | {'yes' if r.prompt_in_verify else 'no'} | "
              f"{r.plain_layer_forwards:g} / {r.strict_layer_forwards:g} | {r.plain_ms:.2f} / {r.strict_ms:.2f} | "
              f"{r.speedup:.2f}x | {r.ceiling:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "pairing", "costs": asdict(costs), "rows": [asdict(r) for r in rows]}, f, indent=1)
