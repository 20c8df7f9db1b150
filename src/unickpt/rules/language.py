"""The universal checkpoint language: rules mapping parameter names to sharding schemes.

    rules = Rules([
        Rule(r"embedding\\.word_embeddings\\.weight", vocab(50257), stages="first"),
        Rule(r"decoder\\.layers\\.\\d+\\.self_attention\\.linear_qkv\\.weight", fused([q, kv, kv], units=head_dim)),
        Rule(r"decoder\\.layers\\.\\d+\\.self_attention\\.linear_proj\\.weight", row()),
        Rule(r"decoder\\.layers\\.\\d+\\..*layernorm\\.weight", replicated()),
        ...
    ], renumber=[Renumber(r"decoder\\.layers\\.(\\d+)\\.", "pp", total=24)])

    state = {"model": apply_rules(model.state_dict(), rules, coords, "save")}
    unickpt.save(state, path, metadata={"layout": rules.metadata(coords)})

Names: a rank's state uses *stage-local* names (``layers.2`` on pipeline stage 1). A
:class:`Renumber` maps them to *global* names (``layers.N``); patterns match global
names (the whole name, ``re.fullmatch``); the first rule that matches wins. A rule may
``rename`` the tensor (a template expanded with the match), and a fused scheme may
split into one global tensor per sub-parameter.

Every tensor becomes a :class:`RuledTensor` (a :class:`unickpt.Sharded`) holding a view
of the user's tensor, so ``unickpt.load`` fills the user's tensors in place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import LayoutError
from ..plan.box import Box
from ..plan.piece import box_piece
from .coords import Coords, split_sizes
from .replicas import reconcile
from .ruled import RuledTensor
from .schemes import Fused, Scheme, SchemeLayout, Target, scheme_from_json

MODES = ("save", "load")
STAGES = ("all", "first", "last", "first+last", "any")


@dataclass(frozen=True)
class Renumber:
    """Stage-local indices in names -> global indices (``layers.2`` on pipeline stage 1 of
    4 is ``layers.N``; ``local_experts.0`` on expert rank 3 is ``local_experts.M``).

    ``pattern`` is searched in the name; its group 1 is the local index. ``total`` items
    are split over ``axis`` by ``split`` (``"balanced"``, ``"chunk"`` or explicit counts).
    """

    pattern: str
    axis: str = "pp"
    total: int | None = None
    split: str | tuple[int, ...] = "balanced"

    def __post_init__(self) -> None:
        if self.axis not in ("pp", "ep", "tp", "dp"):
            raise LayoutError(f"renumber: unknown axis {self.axis!r}")
        if re.compile(self.pattern).groups < 1:
            raise LayoutError(f"renumber: pattern {self.pattern!r} needs a group capturing the index")
        if isinstance(self.split, list):
            object.__setattr__(self, "split", tuple(self.split))

    def counts(self, degree: int) -> list[int]:
        """Items held by each rank of the axis."""
        if isinstance(self.split, tuple):
            total = sum(self.split) if self.total is None else self.total
            return split_sizes(total, degree, list(self.split))
        if self.total is None:
            if degree == 1:
                return [1 << 62]
            raise LayoutError(f"renumber {self.pattern!r}: give total= (items over all {self.axis} ranks)")
        return split_sizes(self.total, degree, self.split)

    def to_global(self, name: str, coords: Coords) -> str:
        """The global name of a stage-local name (unchanged if the pattern is absent)."""
        m = re.search(self.pattern, name)
        if m is None:
            return name
        n, r = coords.degree(self.axis), coords.rank_on(self.axis)
        counts = self.counts(n)
        local = int(m.group(1))
        if local >= counts[r]:
            raise LayoutError(f"{name}: index {local} but {self.axis} rank {r} holds {counts[r]} items ({counts})")
        return name[: m.start(1)] + str(sum(counts[:r]) + local) + name[m.end(1) :]

    def to_local(self, name: str, coords: Coords) -> str | None:
        """The stage-local name of a global name on this rank, or None if another rank holds it."""
        m = re.search(self.pattern, name)
        if m is None:
            return name
        n, r = coords.degree(self.axis), coords.rank_on(self.axis)
        counts = self.counts(n)
        g = int(m.group(1)) - sum(counts[:r])
        if not 0 <= g < counts[r]:
            return None
        return name[: m.start(1)] + str(g) + name[m.end(1) :]

    def to_json(self) -> dict[str, Any]:
        """JSON parameters."""
        d: dict[str, Any] = {"pattern": self.pattern, "axis": self.axis}
        if self.total is not None:
            d["total"] = self.total
        d["split"] = list(self.split) if isinstance(self.split, tuple) else self.split
        return d


@dataclass(frozen=True)
class Rule:
    """``pattern`` (a regex matching whole global names) -> ``scheme``.

    ``rename``: a template (``re.Match.expand``) giving the stored name. ``stages``:
    which pipeline stages hold matching tensors: ``"all"``, ``"first"``, ``"last"``,
    ``"first+last"`` (tied embeddings: a replica on both stages, stored once) or ``"any"``
    (no check); a rule matching nothing where it should is an error in strict mode.
    """

    pattern: str
    scheme: Scheme
    rename: str | None = None
    stages: str = "all"

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise LayoutError(f"rule pattern {self.pattern!r} is not a valid regex: {e}") from None
        if self.stages not in STAGES:
            raise LayoutError(f"rule {self.pattern!r}: stages must be one of {STAGES}, not {self.stages!r}")
        if not isinstance(self.scheme, Scheme):
            raise LayoutError(f"rule {self.pattern!r}: scheme must be a Scheme, not {type(self.scheme).__name__}")

    def expected_on(self, coords: Coords) -> bool | None:
        """Whether this rank's stage must hold a match (None: no expectation)."""
        first, last = coords.pp_rank == 0, coords.pp_rank == coords.pp - 1
        return {"all": True, "first": first, "last": last, "first+last": first or last, "any": None}[self.stages]

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        d: dict[str, Any] = {"pattern": self.pattern, "scheme": self.scheme.to_json()}
        if self.rename is not None:
            d["rename"] = self.rename
        if self.stages != "all":
            d["stages"] = self.stages
        return d


@dataclass
class Resolved:
    """One local tensor resolved by the rules: its names, scheme layout and replication."""

    local_name: str
    name: str  # global numbering, before any rename: what the rule matched
    rule_index: int
    rule: Rule
    layout: SchemeLayout
    part_names: list[str]  # stored tensor name of each sub-parameter
    part_shapes: list[tuple[int, ...]]  # stored global shape of each sub-parameter
    split: bool  # each sub-parameter is its own stored tensor
    local_shape: tuple[int, ...] = ()
    renumbered: frozenset[str] = frozenset()  # axes whose rank is part of the name (distinct tensors, not replicas)

    def stored_box(self, t: Target) -> Box:
        """The target's global box in its stored tensor's coordinates."""
        if not self.split:
            return t.global_box
        start = self.layout.parts[t.part][0]
        d = self.layout.dim
        return Box(tuple(o - start if i == d else o for i, o in enumerate(t.global_box.offsets)), t.global_box.lengths)

    def replicas(self, coords: Coords, dp_partitioned: bool = False) -> tuple[int, int]:
        """``(index, count)`` of this rank among ranks holding the very same layout:
        the dp axis (unless ZeRO partitions it), ep (dense tensors) and tied stages."""
        axes = []
        if not dp_partitioned:
            axes.append((coords.dp_rank, coords.dp))
        if self.layout.axis != "ep" and "ep" not in self.renumbered:
            axes.append((coords.ep_rank, coords.ep))
        if self.rule.stages == "first+last" and coords.pp > 1:
            axes.append((0 if coords.pp_rank == 0 else 1, 2))
        index, count = 0, 1
        for r, n in axes:
            index, count = index * n + r, count * n
        return index, count


class Rules:
    """An ordered list of :class:`Rule` plus the :class:`Renumber` maps of stage-local names."""

    def __init__(self, rules: list[Rule], renumber: list[Renumber] | tuple[Renumber, ...] = (), name: str = "") -> None:
        self.rules = list(rules)
        self.renumber = list(renumber)
        self.name = name
        self._compiled = [re.compile(r.pattern) for r in self.rules]

    def __repr__(self) -> str:
        return f"Rules({self.name or 'custom'}: {len(self.rules)} rules)"

    def describe(self) -> str:
        """Readable multi-line text of the rules."""
        lines = [f"rules {self.name or '(custom)'}"]
        for r in self.renumber:
            lines.append(f"  renumber /{r.pattern}/ over {r.axis} (total {r.total}, {r.split})")
        for r in self.rules:
            extra = (f" -> {r.rename}" if r.rename else "") + (f" [{r.stages}]" if r.stages != "all" else "")
            lines.append(f"  /{r.pattern}/ {r.scheme.describe()}{extra}")
        return "\n".join(lines)

    def global_name(self, local_name: str, coords: Coords) -> str:
        """The global name of a stage-local name."""
        for r in self.renumber:
            local_name = r.to_global(local_name, coords)
        return local_name

    def local_name(self, global_name: str, coords: Coords) -> str | None:
        """The stage-local name of a global name on this rank: the inverse of
        :meth:`global_name`, each index a :class:`Renumber` map matches (a layer, a local
        expert) made local; None when such an index belongs to another rank. A name no map
        matches (``norm.weight``, ``tok_embeddings.weight``) is returned as it is on every
        rank: whether this rank's stage holds it is its rule's ``stages``, which
        ``rules.find(name)[1].expected_on(coords)`` tells (False: not on this stage)."""
        for r in reversed(self.renumber):
            got = r.to_local(global_name, coords)
            if got is None:
                return None
            global_name = got
        return global_name

    def find(self, name: str) -> tuple[int, Rule, re.Match[str]] | None:
        """The first rule whose pattern matches the whole global ``name``."""
        for i, (rule, rx) in enumerate(zip(self.rules, self._compiled)):
            m = rx.fullmatch(name)
            if m is not None:
                return i, rule, m
        return None

    def resolve(
        self,
        local_name: str,
        local_shape: tuple[int, ...],
        coords: Coords,
        shapes: dict[str, Any] | None = None,
    ) -> Resolved | None:
        """Resolve one local tensor: None if no rule matches it."""
        name = self.global_name(local_name, coords)
        found = self.find(name)
        if found is None:
            return None
        renumbered = frozenset(r.axis for r in self.renumber if re.search(r.pattern, local_name))
        index, rule, m = found
        scheme = rule.scheme
        stored = m.expand(rule.rename) if rule.rename else name
        shape = _lookup_shape(shapes, name, stored)
        if shape is None:
            shape = scheme.global_shape(tuple(local_shape), coords)
        layout = scheme.layout(name, tuple(shape), tuple(local_shape), coords)
        expected = rule.expected_on(coords)
        if expected is False:
            raise LayoutError(f"{local_name} (global {name}) matches rule {rule.pattern!r} whose stages are "
                              f"{rule.stages!r}, but this rank is on pipeline stage {coords.pp_rank} of {coords.pp}")
        if isinstance(scheme, Fused) and scheme.names is not None:
            names = [m.expand(t) for t in scheme.names]
            if len(set(names)) != len(names):
                raise LayoutError(f"{name}: fused sub-parameter names {names} are not distinct")
            d = layout.dim
            shapes_ = [tuple(size if i == d else s for i, s in enumerate(layout.global_shape)) for _, size in layout.parts]
            return Resolved(local_name, name, index, rule, layout, names, shapes_, True, tuple(local_shape), renumbered)
        parts = max(1, len(layout.parts))
        return Resolved(local_name, name, index, rule, layout, [stored] * parts, [layout.global_shape] * parts, False, tuple(local_shape), renumbered)

    def check_coverage(self, matched: set[int], unmatched: list[str], coords: Coords, what: str) -> None:
        """Strict mode: every tensor matched a rule, every rule matched where it should."""
        problems = []
        if unmatched:
            problems.append(f"{len(unmatched)} {what} match no rule: " + ", ".join(unmatched[:10])
                            + (" ..." if len(unmatched) > 10 else ""))
        idle = [r.pattern for i, r in enumerate(self.rules) if i not in matched and r.expected_on(coords)]
        if idle:
            problems.append(f"{len(idle)} rule(s) match no {what} on pipeline stage {coords.pp_rank}: "
                            + ", ".join(repr(p) for p in idle))
        if problems:
            raise LayoutError("; ".join(problems) + " (pass strict=False to allow this)")

    def to_json(self) -> dict[str, Any]:
        """The rules as plain JSON (store them with ``metadata=`` so a checkpoint explains its layout)."""
        return {"name": self.name, "rules": [r.to_json() for r in self.rules], "renumber": [r.to_json() for r in self.renumber]}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Rules:
        """Rebuild rules from :meth:`to_json`."""
        rules = [
            Rule(r["pattern"], scheme_from_json(r["scheme"]), r.get("rename"), r.get("stages", "all"))
            for r in d.get("rules", [])
        ]
        renumber = [
            Renumber(r["pattern"], r.get("axis", "pp"), r.get("total"), tuple(r["split"]) if isinstance(r.get("split"), list) else r.get("split", "balanced"))
            for r in d.get("renumber", [])
        ]
        return Rules(rules, renumber, d.get("name", ""))

    def metadata(self, coords: Coords, **extra: Any) -> dict[str, Any]:
        """What to pass as ``metadata={"layout": ...}`` to explain a rule-described save:
        the rules, the saving job's coordinates (degrees) and any ``extra`` (e.g. ZeRO)."""
        d = {"rules": self.to_json(), "degrees": {a: coords.degree(a) for a in ("tp", "pp", "dp", "ep")}}
        d.update(extra)
        return d


def _lookup_shape(shapes: dict[str, Any] | None, *names: str) -> tuple[int, ...] | None:
    if not shapes:
        return None
    for n in names:
        if n in shapes:
            s = shapes[n]
            return tuple(s.shape) if isinstance(s, torch.Tensor) else tuple(int(x) for x in s)
    return None


def check_mode(mode: str) -> None:
    """Refuse a mode other than ``"save"`` or ``"load"``."""
    if mode not in MODES:
        raise LayoutError(f"mode must be 'save' or 'load', not {mode!r}")


def layout_text(res: Resolved, coords: Coords, extra: str = "") -> str:
    """The manifest ``layout`` text of a rule-described tensor."""
    return f"rule {res.rule.scheme.describe()} at {coords.describe()}{extra}"


def _zero_uncovered(local: torch.Tensor, boxes: list[Box]) -> None:
    """Zero the elements of ``local`` that no box covers (padding), in place."""
    mask = torch.zeros(local.shape, dtype=torch.bool)
    for b in boxes:
        view = mask
        for d, (o, n) in enumerate(zip(b.offsets, b.lengths)):
            view = view.narrow(d, o, n)
        view.fill_(True)
    local.masked_fill_(~mask, 0)


def tensor_leaves(res: Resolved, local: torch.Tensor, coords: Coords, mode: str) -> list[tuple[str, RuledTensor]]:
    """The stored tensors of one local tensor (several when a fused tensor is split).

    ``mode="save"`` keeps only the boxes this rank stores; ``"load"`` keeps every box it
    holds and zero-fills local padding (rows past the vocabulary) in place.
    """
    check_mode(mode)
    if tuple(local.shape) != res.local_shape:
        raise LayoutError(f"{res.local_name}: local shape {list(local.shape)} does not match its layout")
    index, count = res.replicas(coords)
    text = layout_text(res, coords)
    if mode == "load" and not res.layout.covers_local:
        _zero_uncovered(local, [t.local_box for t in res.layout.targets])
    groups: dict[str, list[Target]] = {}
    if not res.split:
        groups[res.part_names[0]] = list(res.layout.targets)
    else:
        for t in res.layout.targets:
            groups.setdefault(res.part_names[t.part], []).append(t)
    out = []
    whole = tuple((0, n) for n in local.shape)
    for name, targets in groups.items():
        shape = res.part_shapes[targets[0].part] if targets else res.part_shapes[0]
        base_pieces = [box_piece(tuple(local.shape), t.local_box, res.stored_box(t)) for t in targets]
        kept = [t for t in targets if t.owner or mode == "load"]
        # the window: the bounding box of the kept boxes (on load, the whole tensor unless split)
        if kept and (mode == "save" or res.split):
            window = tuple(
                (min(t.local_box.offsets[d] for t in kept), max(t.local_box.ends[d] for t in kept) - min(t.local_box.offsets[d] for t in kept))
                for d in range(local.ndim)
            )
        else:
            window = whole
        view = local
        for d, (o, n) in enumerate(window):
            view = view.narrow(d, o, n)
        origin = tuple(o for o, _ in window)
        pieces = [box_piece(tuple(view.shape), t.local_box.relative_to(origin), res.stored_box(t)) for t in kept]
        out.append((name, RuledTensor(view, tuple(shape), pieces, index, count, text, res.layout.reduce, local, base_pieces, window)))
    return out


def _is_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def apply_rules(
    state: dict[str, Any],
    rules: Rules,
    coords: Coords,
    mode: str,
    *,
    shapes: dict[str, Any] | None = None,
    strict: bool = True,
    check_replicas: bool = True,
    process_group: Any = None,
) -> dict[str, Any]:
    """Turn a rank's model state (``{stage-local name: local tensor}``, e.g.
    ``model.state_dict()``) into ``{global name: RuledTensor}`` for ``unickpt.save`` or
    ``unickpt.load``.

    ``mode`` is ``"save"`` (each box is stored by one rank; replicas are checked or
    averaged, a collective over ``process_group`` when one is active) or ``"load"``
    (every box the rank holds is filled; padding is zeroed in place). ``shapes`` gives
    global shapes where a local shape cannot tell (uneven widths), keyed by global name.
    In strict mode a tensor matching no rule, or a rule matching nothing where its
    ``stages`` say it should, is a LayoutError; otherwise unmatched tensors pass through
    unchanged. Non-tensor entries pass through under their global names.
    """
    check_mode(mode)
    out: dict[str, Any] = {}
    matched: set[int] = set()
    unmatched: list[str] = []
    for local_name, value in state.items():
        gname = rules.global_name(str(local_name), coords)
        if not _is_tensor(value) or _is_dtensor(value):
            put_unique(out, gname, value)
            continue
        res = rules.resolve(str(local_name), tuple(value.shape), coords, shapes)
        if res is None:
            unmatched.append(gname)
            if not strict:
                put_unique(out, gname, value)
            continue
        matched.add(res.rule_index)
        for name, leaf in tensor_leaves(res, value, coords, mode):
            put_unique(out, name, leaf)
    if strict:
        rules.check_coverage(matched, unmatched, coords, "tensors")
    if mode == "save" and check_replicas:

        reconcile(out, coords, process_group)
    return out


def optimizer_state(
    state: dict[str, dict[str, Any]],
    rules: Rules,
    coords: Coords,
    mode: str,
    *,
    shapes: dict[str, Any] | None = None,
    strict: bool = True,
    check_replicas: bool = True,
    process_group: Any = None,
) -> dict[str, dict[str, Any]]:
    """Per-parameter optimizer state of a job without ZeRO: ``{stage-local param name:
    {key: tensor or value}}`` -> ``{global name: {key: RuledTensor or value}}``.

    Any key passes (Adam's ``exp_avg``/``exp_avg_sq``, Muon's momentum, ...): a tensor
    with the parameter's local shape is laid out like the parameter; a 0-d tensor
    (``step``) is stored once for all the ranks holding the parameter. Put the result
    under ``{"optim": {"state": ...}}`` to match torch's own optimizer state names.
    """
    check_mode(mode)
    out: dict[str, dict[str, Any]] = {}
    matched: set[int] = set()
    unmatched: list[str] = []
    for local_name, entries in state.items():
        if not isinstance(entries, dict):
            raise LayoutError(f"optimizer state of {local_name!r} must be a dict of tensors and values")
        gname = rules.global_name(str(local_name), coords)
        shaped = [v for v in entries.values() if _is_tensor(v) and v.ndim > 0]
        found = rules.find(gname)
        if found is None:
            unmatched.append(gname)
            if not strict:
                out.setdefault(gname, {}).update(entries)
            continue
        matched.add(found[0])
        res = rules.resolve(str(local_name), tuple(shaped[0].shape), coords, shapes) if shaped else None
        names = list(dict.fromkeys(res.part_names)) if res is not None else [gname]
        for key, v in entries.items():
            if _is_tensor(v) and v.ndim > 0:
                assert res is not None
                if tuple(v.shape) != res.local_shape:
                    raise LayoutError(
                        f"optimizer state {local_name}.{key} has shape {list(v.shape)}, not its parameter's "
                        f"{list(res.local_shape)}; give it a rule of its own"
                    )
                for name, leaf in tensor_leaves(res, v, coords, mode):
                    put_unique(out.setdefault(name, {}), key, leaf, f"{name}.{key}")
            else:
                for name in names:
                    renumbered = frozenset(r.axis for r in rules.renumber if re.search(r.pattern, str(local_name)))
                    leaf = scalar_leaf(v, coords, found[1], renumbered) if _is_tensor(v) else v
                    put_unique(out.setdefault(name, {}), key, leaf, f"{name}.{key}")
    if strict:
        rules.check_coverage(matched, unmatched, coords, "optimizer states")
    if mode == "save" and check_replicas:

        reconcile(out, coords, process_group)
    return out


def scalar_leaf(t: torch.Tensor, coords: Coords, rule: Rule | None = None, renumbered: frozenset[str] = frozenset()) -> RuledTensor:
    """A 0-d per-parameter tensor (a step count) that every rank holding the parameter
    has: stored once (tp rank 0, one dp/ep replica), checked for agreement on save.
    ``renumbered``: axes whose rank is part of the parameter's name (not replicas)."""
    from ..plan.piece import whole_piece

    axes = [(coords.dp_rank, coords.dp)]
    if "ep" not in renumbered:
        axes.append((coords.ep_rank, coords.ep))
    if rule is not None and rule.stages == "first+last" and coords.pp > 1:
        axes.append((0 if coords.pp_rank == 0 else 1, 2))
    index, count = 0, 1
    for r, n in axes:
        index, count = index * n + r, count * n
    piece = whole_piece(tuple(t.shape))
    return RuledTensor(t, tuple(t.shape), [piece] if coords.tp_rank == 0 else [], index, count, "rule scalar", "check", t, [piece],
                       tuple((0, n) for n in t.shape))


def put_unique(d: dict[str, Any], name: str, value: Any, shown: str | None = None) -> None:
    """``d[name] = value``, refusing a second tensor under one global name (``shown`` in the error)."""
    if name in d:
        raise LayoutError(f"two tensors of the state map to the same global name {shown or name!r}")
    d[name] = value


def _is_dtensor(v: Any) -> bool:
    from ..engine.items import is_dtensor

    return is_dtensor(v)
