"""One bundle against another in ``recsvc eval --against``: the same users, history rule, protocol, cutoffs and
metric code for both, the ratio A / B per metric and cutoff with its 95% paired bootstrap interval, on every user
and on the cold / warm slices.

    recsvc eval --bundle A --against B [--against-label base]      # two builds
    recsvc eval --bundle A --against-variant no-dense              # A without its dense head
    recsvc eval --bundle A --against B --against-variant no-slots  # B without its fresh slots

B is ranked as it is served (its own prior, dense head and fresh slots), less what ``eval``'s ``--no-prior``,
``--no-dense`` and ``--no-fresh`` leave out of A, less what ``--against-variant`` names. Both are ranked with A's
history rule (``--exclude-history``/``--keep-history`` else A's bundle.json), A's protocol and A's data
directory; the slices are A's (cold: items nobody interacted with in the fitting period, in A's catalog).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recsvc.errors import UserError
from training.evaluation.bundle_ranking import VARIANTS, Parts, Ranked
from training.evaluation.paired import SLICES, lead_cell


@dataclass(frozen=True)
class Against:
    """The second side of a comparison: a bundle (default: the evaluated one) and a part left out of it."""

    bundle: Path
    label: str
    variant: str | None = None  # one of VARIANTS

    @classmethod
    def from_args(cls, bundle: str, against: str | None, variant: str | None, label: str | None) -> Against | None:
        """``--against`` / ``--against-variant`` / ``--against-label`` -> the comparison asked for, or None."""
        if against is None and variant is None:
            if label is not None:
                raise UserError("--against-label needs --against BUNDLE and/or --against-variant")
            return None
        if variant is not None and variant not in VARIANTS:
            raise UserError(f"--against-variant takes one of {', '.join(VARIANTS)}, got {variant!r}")
        other = Path(against or bundle)
        if not (other / "bundle.json").is_file():
            raise UserError(f"--against {other}: not a bundle (no bundle.json)")
        default = other.name if other.name not in ("bundle", "") else f"{other.parent.name}/{other.name}"
        return cls(other, label or (f"{default} {variant}" if variant else default), variant)

    def same_bundle(self, bundle: str | Path) -> bool:
        return self.bundle.resolve() == Path(bundle).resolve()


def check_variant(against: Against, exclude_history: bool, protocol: str) -> None:
    """Refuse a variant that leaves out a part the bundle does not have (the comparison would be A against
    itself under another name)."""
    from recsvc.bundle.directory import Bundle
    from recsvc.content.dense_head import has_dense_head

    if against.variant is None:
        return
    bundle = Bundle.open(against.bundle)
    train_only = protocol == "paper" and bundle.read().get("protocol", "paper") == "deploy"
    target = bundle.train_only_target_dir if train_only else bundle.target_dir
    has = {"no-prior": bundle.has_prior(exclude_history), "no-dense": has_dense_head(target),
           "no-slots": bundle.has_fresh()}[against.variant]
    if not has:
        part = {"no-prior": "prior", "no-dense": "dense head", "no-slots": "fresh slots (BUNDLE/fresh)"}
        raise UserError(f"--against-variant {against.variant}: {against.bundle} has no {part[against.variant]}")


def against_block(against: Against, b: Ranked, parts: Parts, leads: dict[str, Any], metrics: dict[str, Any],
                  served: dict[str, Any]) -> dict[str, Any]:
    """The eval JSON's ``"against"``: what B is, its metrics (with slices) and A / B per slice (``leads``)."""
    return {"label": against.label, "bundle": str(against.bundle), "variant": against.variant,
            "parts": {"prior": parts.prior, "dense": parts.dense, "fresh": parts.fresh},
            "target": "target-train" if b.train_only else "target", "metrics": metrics, "lead": leads,
            "seconds": round(b.seconds, 1), **served}


def format_against(result: dict[str, Any]) -> str:
    """The printed table of A against B: per metric and cutoff, both means and A / B on every user and each slice."""
    block = result["against"]
    lead = block["lead"]
    users = {part: int(next(iter(lead[part].values()))["users"]) if lead.get(part) else 0 for part in SLICES}
    lines = [f"A / B, paired per user (95% bootstrap interval; where B scores 0, the difference A - B +- its standard "
             f"error): A = this bundle as evaluated, B = {block['label']} ({block['bundle']}"
             f"{', ' + block['variant'] if block['variant'] else ''}); same users, history rule and protocol",
             f"| metric | A | B | A / B, all ({users['all']} users) | cold ({users['cold']}) "
             f"| warm ({users['warm']}) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for k in result["ks"]:
        for m in ("recall", "ndcg"):
            key = f"{m}@{k}"
            lines.append(f"| {key} | {result['model'][key]:.4f} | {block['metrics'][key]:.4f} | "
                         + " | ".join(lead_cell(lead[part].get(key)) for part in SLICES) + " |")
    return "\n".join(lines)
