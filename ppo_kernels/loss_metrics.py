"""ppo_loss's metrics dict, computed when it is first read (LossMetrics).

On a small call the metrics are a large part of the cost: one op over the [B, T]
per-token values, then a 0-d tensor per metric (each a Python object), about 50 of the
~250 us of a B 2, T 8 forward on the CPU (2026-12-06, AMD EPYC, 1 thread). A trainer that
logs every k-th step, a benchmark or a gradient check never reads most of them, so on the
paths where deferring is safe the dict is filled at its first read instead: a caller that
reads no metric pays for none, one that reads any gets every metric, with the bits the
eager computation gives (the same op on the same tensors).

Deferring is safe when the computation reads nothing but the call's own tensors, in a
fixed order, without collectives or device streams: the cpu backend's one metrics op, in
eager mode, outside a context-parallel group (loss.loss_metrics decides). The tensors it
reads that belong to the caller (response_mask, old_logprobs, ...) are watched through
their version counters: changed in place before the first read, they would give other
metrics than the call's, so that read raises a RuntimeError naming the argument instead.
"""

from __future__ import annotations

import collections
import copy

import torch
import torch.utils._pytree as pytree


class LossMetrics(dict):
    """The metrics dict of ppo_loss / ppo_loss_from_hidden (a dict: every dict operation
    works and reads the filled values; copied or deep-copied it becomes a plain dict,
    pickled or torch.save'd it loads as a collections.OrderedDict of the same items, which
    torch.load(weights_only=True) accepts). Filled at the first read when the call deferred
    it (module docstring), else filled at once.

    Raises:
        RuntimeError at the first read when a watched input (named in the message) was
        changed in place after the call, before any read; and whatever computing the
        metrics raises (the dict stays unfilled, the next read tries again).
    """

    __slots__ = ("_pending",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending = None

    @classmethod
    def deferred(cls, fill, watched):
        """A dict that calls fill() (-> dict of the metrics) at its first read. watched:
        (argument name, tensor or None) of the caller's tensors fill reads. Under
        torch.inference_mode, or when one of them is an inference tensor (old log-probs
        scored under inference_mode, say), fill()'s dict at once: an inference tensor has
        no version counter, so a later in-place change (in another inference_mode block)
        could not be told."""
        if torch.is_inference_mode_enabled():
            return fill()
        versions = []
        for name, t in watched:  # (a loop, not comprehensions: this runs on every call)
            if t is not None:
                if t.is_inference():
                    return fill()
                versions.append((name, t, t._version))
        out = cls()
        out._pending = (fill, versions)
        return out

    def _filled(self):
        pending = self._pending
        if pending is not None:
            fill, watched = pending
            for name, t, version in watched:
                if t._version != version:
                    raise RuntimeError(
                        f"{name}: changed in place after ppo_loss returned and before its "
                        f"metrics were first read; the metrics are computed at that first "
                        f"read (ppo_kernels.LossMetrics), from the call's tensors: read "
                        f"them (any key) before changing the inputs in place")
            with torch.no_grad():
                values = fill()
            dict.update(self, values)
            self._pending = None
        return self

    # every read and write fills first (the writes keep the eager dict's key order): the
    # dict's own methods on the filled dict (_FILLED_FIRST below), and these
    def __eq__(self, other):
        if isinstance(other, LossMetrics):  # (dict's comparison reads the other's storage)
            other._filled()
        return dict.__eq__(self._filled(), other)

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None

    def __or__(self, other):
        return dict.__or__(dict(self._filled()), other)

    def __ror__(self, other):
        return dict.__or__(dict(other), dict(self._filled()))

    def __ior__(self, other):
        dict.update(self._filled(), other)
        return self

    def clear(self):
        self._pending = None
        dict.clear(self)

    def copy(self):
        return dict(self._filled())

    __copy__ = copy

    def __deepcopy__(self, memo):
        return copy.deepcopy(dict(self._filled()), memo)

    def __reduce__(self):
        # pickled (torch.save included) as an OrderedDict of the items: a dict subclass
        # pickles by its class, which torch.load(weights_only=True) refuses, and builtins
        # dict is not among its allowed globals either; OrderedDict (a state dict's type) is
        return (collections.OrderedDict, (list(self._filled().items()),))


def _on_filled(name):
    """dict.<name> called on the filled dict."""
    method = getattr(dict, name)

    def on_filled(self, *args, **kwargs):
        return method(self._filled(), *args, **kwargs)

    on_filled.__name__, on_filled.__doc__ = name, method.__doc__
    on_filled.__qualname__ = f"LossMetrics.{name}"
    return on_filled


_FILLED_FIRST = ("__getitem__", "__setitem__", "__delitem__", "__contains__", "__iter__",
                 "__reversed__", "__len__", "__repr__", "keys", "values", "items", "get",
                 "pop", "popitem", "setdefault", "update")
for _name in _FILLED_FIRST:
    setattr(LossMetrics, _name, _on_filled(_name))


# torch's pytree (tree_map, torch.compile's and torch.func's flattening) takes it as the
# dict it is, not as one leaf
def _flatten(m):
    m = m._filled()
    return list(dict.values(m)), list(dict.keys(m))


pytree.register_pytree_node(LossMetrics, _flatten, lambda values, keys: dict(zip(keys, values)),
                            serialized_type_name="ppo_kernels.LossMetrics")
