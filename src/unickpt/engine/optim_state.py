"""Optimizers in a state dict: their state stored by parameter name, and loaded into a fresh one.

``torch.optim.Optimizer.state_dict()`` keys per-parameter state by integer ids (positions
in the optimizer's parameter order) and its ``param_groups`` list those ids. unickpt
stores an optimizer found as a Stateful object in the state dict by *parameter name*
instead, exactly as torch's ``get_state_dict`` does: ``optim.state.<param name>.exp_avg``,
``optim.param_groups`` whose ``params`` are names. So a checkpoint saved from the plain
objects loads through ``get_state_dict``/``set_state_dict`` and the other way round.

Naming rule: an optimizer is matched to the modules (``nn.Module``) in the same state
dict that hold its parameters. When one module holds them all, a parameter is named as
in that module (``named_parameters()``, without the ``module.``/``_orig_mod.``/
``_checkpoint_wrapped_module.``/``_fsdp_wrapped_module.`` parts that DDP, torch.compile
and wrappers insert, as ``get_state_dict`` names it); when they are spread over several
modules, by the module's key and that name (``encoder.layer.weight``). With no module
holding any of them, the names the optimizer was built with (``param_names``, from
``Optimizer(model.named_parameters())``) are used, else the integer ids (the state is then
tied to the parameter order, as torch's own ``state_dict`` is). An optimizer holding
parameters of which only some belong to the modules of the state dict is an error.

Loading into a freshly built optimizer (never stepped, empty ``state``): the state
entries are built from what the checkpoint holds for each parameter (its shape and dtype;
a state tensor shaped like a DTensor parameter becomes a DTensor with the parameter's
mesh and placements) and then filled like any target, on any layout. Checkpoints that
stored an optimizer by integer ids (unickpt before this scheme) still load; saved groups
that list integer ids beside state stored by name (DeepSpeed's flat groups) give their
hyperparameters to the optimizer's groups at the same positions.
"""

from __future__ import annotations

import warnings
from itertools import chain
from typing import Any

import torch

from ..dist import is_dtensor
from ..errors import MismatchError, UnickptError
from ..format.dtypes import dtype_from_name
from ..format.manifest import Manifest
from ..format.values import decode_value

_WRAPPER_PARTS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def is_optimizer(obj: Any) -> bool:
    """True for a torch optimizer."""
    return isinstance(obj, torch.optim.Optimizer)


def _module_names(module: torch.nn.Module) -> dict[int, str]:
    ddp = torch.nn.parallel.DistributedDataParallel
    inner = module.__dict__.get("_modules", {}).get("_orig_mod", module)  # torch.compile's wrapper
    skip_first = isinstance(inner, ddp)
    out = {}
    for name, p in module.named_parameters():
        parts = [part for part in name.split(".") if part not in _WRAPPER_PARTS]
        if skip_first and parts and parts[0] == "module":
            parts = parts[1:]
        out[id(p)] = ".".join(parts)
    return out


def _flat_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for p in chain.from_iterable(g["params"] for g in optimizer.param_groups):
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def parameter_keys(optimizer: torch.optim.Optimizer, modules: list[tuple[str, torch.nn.Module]], where: str) -> list[Any]:
    """The key of each of ``optimizer``'s parameters (in its order) by the naming rule of
    this module's docstring: names, or integer positions when nothing names them."""
    params = _flat_params(optimizer)
    ids = [id(p) for p in params]
    tables = [(key, _module_names(m)) for key, m in modules]
    for _, names in tables:
        if all(i in names for i in ids):
            return [names[i] for i in ids]
    combined: dict[int, str] = {}
    for key, names in tables:
        for i, n in names.items():
            combined.setdefault(i, f"{key}.{n}")
    found = [i in combined for i in ids]
    if all(found):
        return [combined[i] for i in ids]
    if any(found):
        missing = [tuple(p.shape) for p, f in zip(params, found) if not f]
        raise UnickptError(
            f"{where!r}: this optimizer holds {len(missing)} parameters (shapes {missing[:4]}) that no module in the "
            "state dict holds, and others that one does; put every module it optimizes in the state dict, so its "
            "state is stored by parameter name"
        )
    groups = optimizer.param_groups
    if all("param_names" in g and len(g["param_names"]) == len(g["params"]) for g in groups):
        named = {id(p): n for g in groups for p, n in zip(g["params"], g["param_names"])}
        if len(set(named.values())) == len(named):
            return [named[i] for i in ids]
    return list(range(len(params)))


def named_parameters(optimizer: torch.optim.Optimizer, modules: list[tuple[str, torch.nn.Module]],
                     where: str) -> list[tuple[str, torch.Tensor]]:
    """Each of ``optimizer``'s parameters (once, in its order) with its key as text (see
    :func:`parameter_keys`)."""
    return [(str(k), p) for k, p in zip(parameter_keys(optimizer, modules, where), _flat_params(optimizer))]


def held_names(optimizer: torch.optim.Optimizer, modules: list[tuple[str, torch.nn.Module]]) -> set[str]:
    """Every parameter name this rank's modules hold, by the naming :func:`parameter_keys`
    uses for ``optimizer`` (empty when it names its parameters otherwise)."""
    ids = [id(p) for p in _flat_params(optimizer)]
    tables = [(key, _module_names(m)) for key, m in modules]
    for _, names in tables:
        if all(i in names for i in ids):
            return set(names.values())
    return {f"{key}.{n}" for key, names in tables for n in names.values()}


class NamedOptimizer:
    """A torch optimizer seen as a Stateful object whose state is keyed by parameter keys
    (names, or integer positions: see :func:`parameter_keys`). ``held``: the names of
    every parameter this rank's modules hold; saved state of parameters outside it belongs
    to another rank's part of the model (a pipeline stage) and is not this optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, keys: list[Any], held: set[str] | None = None) -> None:
        self.held = held or set()
        self.optimizer = optimizer
        self.params = _flat_params(optimizer)
        self.keys = keys
        self.by_name = bool(keys) and isinstance(keys[0], str)

    def _key_of_id(self, packed: dict[str, Any]) -> dict[Any, Any]:
        """Packed integer id (of ``optimizer.state_dict()``) -> this view's key."""
        position = {id(p): k for p, k in zip(self.params, self.keys)}
        return {
            pid: position[id(p)]
            for pid, p in zip(
                chain.from_iterable(g["params"] for g in packed["param_groups"]),
                chain.from_iterable(g["params"] for g in self.optimizer.param_groups),
            )
        }

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict with parameter keys in place of its integer ids."""
        sd = self.optimizer.state_dict()
        if not self.by_name:
            return sd
        key_of = self._key_of_id(sd)
        out = dict(sd)
        out["state"] = {key_of.get(k, k): v for k, v in sd["state"].items()}
        out["param_groups"] = [{**g, "params": [key_of[p] for p in g["params"]]} for g in sd["param_groups"]]
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Give the optimizer ``sd`` (keyed by this view's keys) through its own
        ``load_state_dict``: saved groups are matched to its groups by the names they hold."""
        if not self.by_name:
            self.optimizer.load_state_dict(sd)
            return
        position = {k: i for i, k in enumerate(self.keys)}
        groups = self.optimizer.param_groups
        saved = sd["param_groups"]
        if len(saved) != len(groups):
            raise MismatchError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this one {len(groups)}")
        key = dict(zip(map(id, self.params), self.keys))
        packed_groups = []
        for i, (s, g) in enumerate(zip(saved, groups)):
            names = [key[id(p)] for p in g["params"]]
            if all(isinstance(p, int) for p in s["params"]):
                # groups of a foreign checkpoint that name no parameter (DeepSpeed's flat
                # groups): its hyperparameters go to the group at the same position
                packed_groups.append({**s, "params": [position[n] for n in names]})
                continue
            others = {str(p) for p in s["params"]} - set(names)  # another pipeline stage's part of the group
            if not set(names) <= {str(p) for p in s["params"]} or any(_held_by(p + ".x", self.held) for p in others):
                extra = sorted(set(map(str, s["params"])) - set(names))[:3]
                lacking = sorted(set(names) - set(map(str, s["params"])))[:3]
                raise MismatchError(
                    f"parameter group {i} of the checkpoint's optimizer holds other parameters than this one's "
                    f"(saved only: {extra}, here only: {lacking})"
                )
            packed_groups.append({**s, "params": [position[n] for n in names]})
        state = {position[k]: v for k, v in sd["state"].items() if k in position}
        self.optimizer.load_state_dict({**sd, "state": state, "param_groups": packed_groups})

    def target_state_dict(self, where: str, manifest: Manifest, strict: bool) -> dict[str, Any]:
        """The state dict to fill from ``manifest`` (the optimizer stored under ``where``):
        the optimizer's own, plus an entry of the saved shape and dtype for each state
        tensor or value the checkpoint holds and the optimizer does not have yet."""
        state_prefix = f"{where}.state."
        saved = [n for n in chain(manifest.tensors, manifest.values) if n.startswith(state_prefix)]
        groups_saved = f"{where}.param_groups" in manifest.values or any(
            n.startswith(f"{where}.param_groups.") for n in chain(manifest.tensors, manifest.values)
        )
        if not saved and not groups_saved and f"{where}.state" not in manifest.values:
            msg = (
                f"{where!r}: the checkpoint holds no state for this optimizer ({type(self.optimizer).__name__}); "
                "it would keep its current state"
            )
            if strict:
                raise MismatchError(msg + " (pass strict=False to load the rest and keep it as it is)")
            warnings.warn(msg, stacklevel=4)
            return self.state_dict()
        if self.by_name and _saved_by_id(manifest, where, saved, self.keys):
            self.by_name = False  # a checkpoint from before names: its state is tied to the parameter order
            self.keys = list(range(len(self.params)))
        elif not self.by_name and _saved_by_name(manifest, where):
            raise MismatchError(
                f"{where!r}: the checkpoint stores this optimizer's state by parameter name; put the model it "
                "optimizes beside it in the state dict (or build the optimizer from model.named_parameters())"
            )
        sd = self.state_dict()
        matched, unmatched = _match(saved, state_prefix, [str(k) for k in self.keys])
        if matched and self.held:  # another pipeline stage's parameters: not this optimizer's
            unmatched = [n for n in unmatched if _held_by(n[len(state_prefix):], self.held)]
        if unmatched:
            msg = (
                f"{where!r}: the checkpoint holds optimizer state for parameters this optimizer does not hold "
                f"({', '.join(sorted(unmatched)[:4])}{' ...' if len(unmatched) > 4 else ''}; it holds "
                f"{', '.join(map(str, self.keys[:4]))}{' ...' if len(self.keys) > 4 else ''})"
            )
            if strict or not matched:
                raise MismatchError(msg)
            warnings.warn(msg + "; that state is skipped", stacklevel=4)
        by_str = {str(k): (k, p) for k, p in zip(self.keys, self.params)}
        for key_text, rests in matched.items():
            key, param = by_str[key_text]
            entry_state = sd["state"].setdefault(key, {})
            for rest, full in rests:
                _place(entry_state, rest.split("."), lambda full=full: _empty_for(manifest, full, param))
        return sd


def _saved_group_params(manifest: Manifest, where: str) -> list[Any] | None:
    raw = manifest.values.get(f"{where}.param_groups")
    if raw is None:
        return None
    groups = decode_value(raw)
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return None
    return [p for g in groups for p in g["params"]]


def _saved_by_id(manifest: Manifest, where: str, saved: list[str], names: list[str]) -> bool:
    """Whether the checkpoint keyed this optimizer's state by integer ids (unickpt before
    names): its saved state names start with integers and none with one of ``names``;
    with no saved state, its ``param_groups`` list integers."""
    prefix = f"{where}.state."
    if saved:
        by_name, _ = _match(saved, prefix, names)
        _, unmatched = _match(saved, prefix, [str(i) for i in range(len(names))])
        return not by_name and not unmatched
    params = _saved_group_params(manifest, where)
    return bool(params) and all(isinstance(p, int) for p in params)


def _saved_by_name(manifest: Manifest, where: str) -> bool:
    params = _saved_group_params(manifest, where)
    return params is not None and any(isinstance(p, str) for p in params)


def _match(saved: list[str], prefix: str, keys: list[str]) -> tuple[dict[str, list[tuple[str, str]]], list[str]]:
    """Group the saved state names by the parameter key they start with (the longest
    one: names hold dots). Returns ({key: [(rest, full name)]}, names matching no key)."""
    known = set(keys)
    matched: dict[str, list[tuple[str, str]]] = {}
    unmatched = []
    for full in saved:
        rest = full[len(prefix) :]
        parts = rest.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            key = ".".join(parts[:cut])
            if key in known:
                matched.setdefault(key, []).append((".".join(parts[cut:]), full))
                break
        else:
            unmatched.append(full)
    return matched, unmatched


def _held_by(rest: str, held: set[str]) -> bool:
    """Whether the state name ``rest`` (``<parameter name>.<state key>``) is of a parameter
    in ``held``."""
    parts = rest.split(".")
    return any(".".join(parts[:cut]) in held for cut in range(len(parts) - 1, 0, -1))


def _place(node: dict[Any, Any], path: list[str], make: Any) -> None:
    """Put ``make()`` at ``path`` below ``node`` unless something is there already."""
    for part in path[:-1]:
        key = _existing_key(node, part)
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            return
        node = child
    key = _existing_key(node, path[-1])
    if key not in node:
        node[key] = make()


def _existing_key(node: dict[Any, Any], text: str) -> Any:
    """The key of ``node`` spelled ``text`` (state dicts may use int keys), else ``text``."""
    for k in node:
        if str(k) == text:
            return k
    return text


def _empty_for(manifest: Manifest, name: str, param: torch.Tensor) -> Any:
    """A target for the saved entry ``name`` of ``param``'s state: None for a value (load
    replaces it), else an empty tensor of the saved shape and dtype, laid out like
    ``param`` (a DTensor with its placements) when it has ``param``'s shape."""
    entry = manifest.tensors.get(name)
    if entry is None:
        return None
    dtype = dtype_from_name(entry.dtype)
    shape = tuple(entry.shape)
    if shape and tuple(param.shape) == shape:
        if is_dtensor(param):
            return torch.empty_like(param.detach(), dtype=dtype)
        return torch.empty(shape, dtype=dtype, device=param.device)
    return torch.empty(shape, dtype=dtype)


def _keyed_by_ids(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.state_dict()`` keys parameters by integer ids (torch's own
    ``state_dict``, not one a subclass or hook replaced by names)."""
    if type(optimizer).state_dict is torch.optim.Optimizer.state_dict and not getattr(
        optimizer, "_optimizer_state_dict_post_hooks", None
    ):
        return True
    groups = optimizer.state_dict().get("param_groups")
    return isinstance(groups, list) and all(
        isinstance(g, dict) and all(isinstance(p, int) for p in g.get("params", [None])) for g in groups
    )


def named_optimizer(optimizer: torch.optim.Optimizer, modules: list[tuple[str, torch.nn.Module]], where: str) -> Any:
    """``optimizer`` seen through parameter keys, or the optimizer itself when its own
    ``state_dict`` does not use integer ids (it names its parameters already)."""
    if not _keyed_by_ids(optimizer):
        return optimizer
    return NamedOptimizer(optimizer, parameter_keys(optimizer, modules, where), held_names(optimizer, modules))
