"""Naming what differs between a call and the sample a pipeline was captured from.

A captured graph is specialised on the sample's call structure: which arguments are passed
positionally or by keyword, the shape of every container, the value of every non-tensor
argument. :meth:`fxpipe.capture._tracing.Capture.flatten_inputs` takes the fast path when a call
matches; when it does not, this module walks the call and the sample side by side and
names each argument that differs, with what to do, instead of printing two TreeSpecs.
"""

from __future__ import annotations

import collections
import inspect
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import InputMismatchError
from ._values import same_plain

if TYPE_CHECKING:
    from ._tracing import Capture

__all__ = ["call_signature", "flatten_call", "check_micro_batches", "in_sample_order", "mismatch_error"]


# -- a call vs the captured sample (Capture.flatten_inputs) -----------------------------------
def call_signature(model: nn.Module) -> inspect.Signature | None:
    """The forward signature, kept on :class:`Capture` to name arguments in call errors."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _model_name(c: Capture) -> str:
    """The model's class name, '' when unknown (a deep-copied GraphModule forgets it)."""
    name = type(c.graph_module).__name__
    return "" if name == "GraphModule" else name


def _mismatch_message(cls: str, problems: list[tuple[str, str]]) -> str:
    head = f"{cls + ': ' if cls else ''}this call does not match the sample the pipeline was built with"
    if not problems:  # a container type whose difference the walk does not describe
        problems = [("its arguments are structured differently (containers, keys or lengths)",
                     "call it with arguments structured exactly as in the sample, or build the pipeline "
                     "with a sample structured like this call")]
    if len(problems) == 1:
        return f"{head}: {problems[0][0]}; {problems[0][1]}"
    return f"{head}:\n" + "\n".join(f"  - {detail}; {todo}" for detail, todo in problems)


def _spec_children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _names(names: Sequence[str]) -> str:
    return ", ".join(names)


def _describe_value(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {tuple(v.shape)}"
    if v is None:
        return "None"
    text = repr(v)
    return f"{text} ({type(v).__name__})" if len(text) <= 40 else f"a {type(v).__name__}"


def _short(v: Any) -> str:
    """``0.5``, ``None``, ``a tensor of shape (4, 8)``: a value as a message shows it."""
    if isinstance(v, torch.Tensor):
        return _describe_value(v)
    text = repr(v)
    return text if len(text) <= 40 else f"a {type(v).__name__}"


def _keys_of(spec: pytree.TreeSpec) -> list[Any] | None:
    """The keys of a dict-like node, else None."""
    t = spec.type
    if t is None or not isinstance(t, type) or not issubclass(t, dict):
        return None
    ctx = spec.context
    if issubclass(t, collections.defaultdict):  # context: [default_factory, keys]
        ctx = ctx[1] if isinstance(ctx, (list, tuple)) and len(ctx) == 2 else None
    return list(ctx) if isinstance(ctx, (list, tuple)) else None


def _namedtuple_class(spec: pytree.TreeSpec) -> type | None:
    """A namedtuple node's class (pytree's type is the ``collections.namedtuple`` function)."""
    ctx = spec.context
    return ctx if spec.type is collections.namedtuple and isinstance(ctx, type) else None


def _describe_node(spec: pytree.TreeSpec) -> str:
    keys = _keys_of(spec)
    name = getattr(spec.type, "__name__", str(spec.type))
    cls = _namedtuple_class(spec)
    if cls is not None:
        return f"a namedtuple {cls.__name__}"
    if keys is not None:
        return f"a {name} with keys {keys}"
    if spec.type in (list, tuple) or (isinstance(spec.type, type) and issubclass(spec.type, tuple)):
        return f"a {name} of {_plural(spec.num_children, 'item')}"
    return f"a {name}"


def _child_label(spec: pytree.TreeSpec, j: int) -> str:
    keys = _keys_of(spec)
    if keys is not None and j < len(keys):
        return f"[{keys[j]!r}]"
    fields_ = getattr(_namedtuple_class(spec) or spec.type, "_fields", None)  # namedtuple
    if isinstance(fields_, tuple) and j < len(fields_):
        return f".{fields_[j]}"
    return f"[{j}]"


def _var_keyword(c: Capture, name: str) -> bool:
    """Whether keyword ``name`` lands in forward's ``**kwargs`` (or forward is unknown), where
    forward sees the keywords in call order: there, and only there, their order can matter."""
    if c.signature is None:
        return True
    params = c.signature.parameters
    P = inspect.Parameter
    named = name in params and params[name].kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)
    return not named and any(p.kind is P.VAR_KEYWORD for p in params.values())


def in_sample_order(c: Capture, kwargs: dict) -> dict:
    """The call's keywords in the sample's order (the graph's inputs follow it), extra ones last.

    Python binds named parameters by name, so their order means nothing and a call may give
    them in any order. Keywords that land in ``**kwargs`` reach forward in call order, which
    its code may depend on: when their relative order differs from the sample's the call is
    left as it is, and :func:`mismatch_error` names them.
    """
    sample = list(_spec_children(c.in_spec)[1].context)
    if list(kwargs) == sample:
        return kwargs
    free_c = [k for k in kwargs if k in sample and _var_keyword(c, k)]
    if free_c != [k for k in sample if k in kwargs and _var_keyword(c, k)]:
        return kwargs
    rank = {k: i for i, k in enumerate(sample)}
    return {k: kwargs[k] for k in sorted(kwargs, key=lambda k: rank.get(k, len(sample)))}


# -- tensor shapes a capture fixed (fxpipe.capture._shape_guards) ------------------------------
def _shape_problems(v: torch.Tensor, want: tuple[int | None, ...], name: str) -> list[tuple[str, str]]:
    free = [str(d) for d, s in enumerate(want) if s is None]
    may = f"only dim {' and '.join(free)} of it may vary" if free else "none of its dims may vary"
    why = (f"(the capture fixed the sample's size there: the model's code depends on it, it was 1, or a size "
           f"regroups the batch's rows with it; {may})")
    if v.dim() != len(want):
        return [(f"{name} has {v.dim()} dims but the sample's had {len(want)} {why}",
                 f"pass {name} with {len(want)} dims, as in the sample, or build another pipeline from a sample "
                 "shaped like this call")]
    return [(f"dim {d} of {name} is {v.shape[d]}, but it was fixed at {s} when the pipeline was built {why}",
             f"build one pipeline per size, from a sample whose {name} has {v.shape[d]} in dim {d} (pipelines "
             f"of one model share its parameters), or pad or trim {name} to {s} along dim {d}")
            for d, s in enumerate(want) if s is not None and v.shape[d] != s]


def call_input_names(c: Capture, args: tuple, kwargs: dict) -> list[str]:
    """``x``, ``mask``, ``batch['ids']``, ``inputs[1]``: each flat input as a message names it."""
    pos, var = [], None
    if c.signature is not None:
        P = inspect.Parameter
        pos = [p.name for p in c.signature.parameters.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        var = next((p.name for p in c.signature.parameters.values() if p.kind is P.VAR_POSITIONAL), None)
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        top, first, rest = path[0], path[1], path[2:]
        if getattr(top, "idx", 1) == 0:
            i = first.idx
            base = pos[i] if i < len(pos) else f"{var}[{i - len(pos)}]" if var else f"args[{i}]"
        else:
            base = str(first.key)
        names.append(base + pytree.keystr(rest))
    return names


def flatten_call(c: Capture, args: tuple, kwargs: dict) -> list[Any]:
    """:meth:`Capture.flatten_inputs`: the call's flat inputs, in the graph's order, or
    :class:`InputMismatchError` naming every argument that does not fit the capture."""
    kwargs = in_sample_order(c, kwargs)
    flat, spec = pytree.tree_flatten((args, kwargs))
    if spec == c.in_spec and all(
            (same_plain(v, c.specialized[i]) if i in c.specialized else isinstance(v, torch.Tensor))
            for i, v in enumerate(flat)):
        if not c.fixed and not c.guards.dims and not c.guards.conditions:  # fx: every size may vary
            return flat
        names = call_input_names(c, args, kwargs)
        problems = [p for i, want in c.fixed.items() for p in _shape_problems(flat[i], want, names[i])]
        problems = problems or c.guards.problems(flat, names)
        if not problems:
            return flat
        raise InputMismatchError(_mismatch_message(_model_name(c), problems))
    raise mismatch_error(c, args, kwargs, flat, spec)


def check_micro_batches(c: Capture, args: tuple, kwargs: dict, micro: Sequence[Sequence[Any]]) -> None:
    """The capture's guards on the batch (a branch on its size) at each micro-batch's sizes,
    or :class:`InputMismatchError` naming them (:mod:`fxpipe.capture._shape_guards`)."""
    if not c.guards.batch:
        return
    seen: set = set()
    for leaves in micro:
        key = tuple(tuple(x.shape) for x in leaves if isinstance(x, torch.Tensor))
        if key in seen:
            continue
        seen.add(key)
        problems = c.guards.micro_problems(leaves, call_input_names(c, args, in_sample_order(c, kwargs)))
        if problems:
            raise InputMismatchError(_mismatch_message(_model_name(c), [
                (f"a micro-batch of this call: {what}", todo) for what, todo in problems]))


class _CallCheck:
    """Walks a call's ``(args, kwargs)`` pytree against the sample's and lists what differs.

    Each problem is ``(what differs, what to do)``; arguments are named as in the forward
    signature (``x``, ``mask``, ``inputs[1]`` for ``*inputs``, ``batch['ids']`` inside).
    """

    def __init__(self, c: Capture, args: tuple, kwargs: dict, flat: list[Any], spec: pytree.TreeSpec) -> None:
        self.c, self.args, self.kwargs, self.flat = c, args, kwargs, flat
        name = _model_name(c)
        self.forward = f"{name}.forward" if name else "the model's forward"
        self.call_args, self.call_kw = _spec_children(spec)
        self.sample_args, self.sample_kw = _spec_children(c.in_spec)
        params = list(c.signature.parameters.values()) if c.signature is not None else []
        P = inspect.Parameter
        self.pos = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        self.var = next((p.name for p in params if p.kind is P.VAR_POSITIONAL), None)
        self.keywords = [p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
        self.any_keyword = c.signature is None or any(p.kind is P.VAR_KEYWORD for p in params)
        self.problems_: list[tuple[str, str]] = []

    def name(self, i: int) -> str:
        if i < len(self.pos):
            return self.pos[i]
        if self.var is not None:
            return f"{self.var}[{i - len(self.pos)}]"
        return f"args[{i}]"

    def add(self, detail: str, todo: str) -> None:
        self.problems_.append((detail, todo))

    def problems(self) -> list[tuple[str, str]]:
        n_s, n_c = self.sample_args.num_children, self.call_args.num_children
        sk, ck = list(self.sample_kw.context), list(self.call_kw.context)
        done_pos: set[int] = set()
        done_kw: set[str] = set()
        # an argument passed positionally in one call and by keyword in the other
        for i in range(n_s, n_c):
            nm = self.name(i)
            if nm in ck:
                self.add(f"{nm} is passed twice, positionally and as {nm}=", f"pass {nm} once")
                done_pos.add(i)
                done_kw.add(nm)
            elif nm in sk:
                self.add(f"{nm} is passed positionally but the sample passed it by keyword",
                         f"pass it as {nm}=..., as in the sample")
                done_pos.add(i)
                done_kw.add(nm)
        for i in range(n_c, n_s):
            nm = self.name(i)
            if nm in ck and nm not in sk:
                self.add(f"{nm} is passed by keyword ({nm}=...) but the sample passed it positionally",
                         f"pass {nm} positionally, as in the sample")
                done_pos.add(i)
                done_kw.add(nm)
        missing = [self.name(i) for i in range(n_c, n_s) if i not in done_pos]
        if missing:
            self.add(f"positional argument{'s' if len(missing) > 1 else ''} {_names(missing)} "
                     f"{'are' if len(missing) > 1 else 'is'} missing (the sample passed "
                     f"{_plural(n_s, 'positional argument')}, this call {n_c})",
                     f"pass {_names(missing)} as in the sample, or build the pipeline with a sample "
                     f"that leaves {'them' if len(missing) > 1 else 'it'} out")
        extra = [i for i in range(n_s, n_c) if i not in done_pos]
        if extra and self.c.signature is not None and self.var is None and n_c > len(self.pos):
            self.add(f"{self.forward} takes {_plural(len(self.pos), 'positional argument')} "
                     f"({_names(self.pos) or 'none'}) but this call passes {n_c}",
                     "remove the extra arguments")
        elif extra:
            names = [self.name(i) for i in extra]
            self.add(f"{_names(names)} {'are' if len(names) > 1 else 'is'} passed positionally but the sample "
                     f"passed only {_plural(n_s, 'positional argument')}",
                     f"leave {'them' if len(names) > 1 else 'it'} out, as in the sample, or build the pipeline "
                     f"with a sample that passes {_names(names)} too (sample=(...))")
        for k in ck:
            if k in sk or k in done_kw:
                continue
            if not self.any_keyword and k not in self.keywords:
                self.add(f"{self.forward} has no parameter {k!r}",
                         f"remove {k}= (its keyword parameters: {_names(self.keywords) or 'none'})")
            elif self.kwargs[k] is None:
                self.add(f"{k}=None is passed but the sample did not pass {k}",
                         f"leave {k} out, as in the sample, or build the pipeline with "
                         f"sample_kwargs={{{k!r}: None, ...}}")
            else:
                self.add(f"{k}= is passed but the sample did not pass {k}",
                         f"leave {k} out, as in the sample, or build the pipeline with "
                         f"sample_kwargs={{{k!r}: ...}} (a value like this call's)")
        for k in sk:
            if k in ck or k in done_kw:
                continue
            self.add(f"{k}= is missing: the sample passed {k} ({self._sample_kw_desc(k)})",
                     f"pass {k}=..., as in the sample, or build the pipeline without {k} in sample_kwargs")
        common_c = [k for k in ck if k in sk and _var_keyword(self.c, k)]
        common_s = [k for k in sk if k in ck and _var_keyword(self.c, k)]
        if common_c != common_s:  # named parameters may come in any order (in_sample_order)
            self.add(f"the keyword arguments {_names(common_c)} reach {self.forward}'s **kwargs in this order, "
                     f"the sample's in the order {_names(common_s)}",
                     "pass them in the sample's order (forward sees **kwargs in call order; the graph was "
                     "captured with the sample's)")
        # the arguments both pass: walk their containers and leaves
        c_off, s_off = self._offsets(self.call_args), self._offsets(self.sample_args)
        for i in range(min(n_s, n_c)):
            self._walk(self.call_args.child(i), self.sample_args.child(i), self.name(i), self.name(i),
                       c_off[i], s_off[i], keyword=False)
        c_off = self._offsets(self.call_kw, self.call_args.num_leaves)
        s_off = self._offsets(self.sample_kw, self.sample_args.num_leaves)
        for j, k in enumerate(sk):
            if k in ck:
                jc = ck.index(k)
                self._walk(self.call_kw.child(jc), self.sample_kw.child(j), k, k, c_off[jc], s_off[j], keyword=True)
        return self.problems_

    @staticmethod
    def _offsets(spec: pytree.TreeSpec, base: int = 0) -> list[int]:
        out = []
        for child in _spec_children(spec):
            out.append(base)
            base += child.num_leaves
        return out

    def _sample_kw_desc(self, k: str) -> str:
        j = list(self.sample_kw.context).index(k)
        spec = self.sample_kw.child(j)
        if not spec.is_leaf():
            return _describe_node(spec)
        i = self.sample_args.num_leaves + self._offsets(self.sample_kw)[j]
        return self._sample_leaf(i)

    def _sample_leaf(self, si: int) -> str:
        return _short(self.c.specialized[si]) if si in self.c.specialized else "a tensor"

    def _walk(self, cs: pytree.TreeSpec, ss: pytree.TreeSpec, path: str, top: str, ci: int, si: int,
              keyword: bool) -> None:
        rebuild = (f"build the pipeline with sample_kwargs={{{top!r}: ...}} structured like this call's"
                   if keyword else f"build the pipeline with a sample whose {top} is structured like this call's")
        if ss.is_leaf() and cs.is_leaf():
            v = self.flat[ci]
            if si in self.c.specialized:
                want = self.c.specialized[si]
                if not same_plain(v, want):
                    self.add(f"{path} is {_short(v)} but the graph was specialised on the sample's {_short(want)} "
                             "(non-tensor arguments are fixed when the model is captured)",
                             f"pass {_short(want)} for {path}, as in the sample, or build another pipeline whose "
                             f"sample has {_short(v)} there")
            elif isinstance(v, torch.Tensor) and si in self.c.fixed:
                self.problems_ += _shape_problems(v, self.c.fixed[si], path)
            elif not isinstance(v, torch.Tensor):
                self.add(f"{path} is {_describe_value(v)} but the sample passed a tensor there",
                         f"pass a tensor for {path}, as in the sample, or build another pipeline whose sample "
                         f"has {_short(v)} there (non-tensor arguments are fixed when the model is captured)")
            return
        if ss.is_leaf() or cs.is_leaf() or cs.type is not ss.type:
            got = _describe_value(self.flat[ci]) if cs.is_leaf() else _describe_node(cs)
            want = self._sample_leaf(si) if ss.is_leaf() else _describe_node(ss)
            self.add(f"{path} is {got} but the sample passed {want}",
                     f"pass {want} for {path}, as in the sample, or {rebuild}")
            return
        ck, sk = _keys_of(cs), _keys_of(ss)
        if ck is not None and sk is not None:
            if set(ck) != set(sk):
                lacks = [k for k in sk if k not in ck]
                more = [k for k in ck if k not in sk]
                what = "; ".join(([f"missing {lacks}"] if lacks else []) + ([f"unexpected {more}"] if more else []))
                self.add(f"{path} has keys {ck} but the sample's has {sk} ({what})",
                         f"pass {path} with the sample's keys, or {rebuild}")
                return
            if ck != sk:
                self.add(f"{path} has its keys in the order {ck}, the sample's in the order {sk}",
                         "pass them in the sample's order (the graph's inputs follow it)")
                return
        elif cs.num_children != ss.num_children:
            self.add(f"{path} is {_describe_node(cs)} but the sample passed {_describe_node(ss)}",
                     f"pass {path} with {_plural(ss.num_children, 'item')}, as in the sample, or {rebuild}")
            return
        elif cs.context != ss.context:
            self.add(f"{path} is {_describe_node(cs)} structured differently from the sample's",
                     f"pass {path} structured as in the sample, or {rebuild}")
            return
        c_off, s_off = self._offsets(cs, ci), self._offsets(ss, si)
        for j in range(ss.num_children):
            self._walk(cs.child(j), ss.child(j), path + _child_label(ss, j), top, c_off[j], s_off[j], keyword)


def mismatch_error(capture: "Capture", args: tuple, kwargs: dict, flat: list[Any],
                   spec: pytree.TreeSpec) -> InputMismatchError:
    """The error for a call that does not fit ``capture``'s sample, naming every difference."""
    problems = _CallCheck(capture, args, kwargs, flat, spec).problems()
    return InputMismatchError(_mismatch_message(_model_name(capture), problems))
