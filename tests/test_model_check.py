"""The C pass of the CPU graphs' model check (minivllm/engine/csrc/model_check.c): it answers 1
("unchanged") only when every hook dict is empty, the child dicts hold the listed children in
order, every parameter slot holds its listed tensor and every tensor is at its listed address; any
change, or arguments of another shape, gives 0 (the engine then runs the Python check). End to end: tests/test_cpu_graph.py runs
its model-change tests with the C pass and without it."""
from __future__ import annotations

from collections import OrderedDict
from itertools import chain

import pytest
import torch

from minivllm.engine import model_check

from helpers_native import native_or_skip, tensor_data_or_skip


@pytest.fixture(scope="module")
def unchanged():
    return native_or_skip(model_check, "the C model check")


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 2)))


def _args(model: torch.nn.Module) -> tuple:
    """The eight lists, made as the graph runner makes them."""
    modules = list(model.modules())
    hooks = [m._forward_hooks for m in modules] + [m._forward_pre_hooks for m in modules]
    child_dicts = [m._modules for m in modules]
    slots = [(m._parameters, k) for m in modules for k in m._parameters]
    params = [d[k] for d, k in slots]
    tensors = [p for p in params if p is not None]
    return (hooks, child_dicts, list(chain.from_iterable(map(dict.values, child_dicts))),
            [d for d, _ in slots], [k for _, k in slots], params, tensors, [t.data_ptr() for t in tensors])


def _hook(m):
    m.register_forward_hook(lambda *a: None)


def _pre_hook(m):
    m[1][0].register_forward_pre_hook(lambda *a: None)


def _swap_children(m):
    d = m[1]._modules
    d["0"], d["1"] = d["1"], d["0"]


def _reinsert_same_child(m):  # same key -> value, another order: a ModuleList would iterate differently
    d = m[1]._modules
    d["0"] = d.pop("0")


def _add_child(m):
    m[1].add_module("extra", torch.nn.ReLU())


def _remove_child(m):
    del m[1]._modules["1"]


def _replace_parameter(m):
    m[0].weight = torch.nn.Parameter(m[0].weight.detach().clone())


def _new_storage(m):  # the same Parameter object, its data elsewhere (what module.to() does)
    m[0].weight.data = m[0].weight.detach().clone()


def _set_storage(m):
    with torch.no_grad():
        m[1][1].bias.set_(torch.zeros(2))


def _empty_slot(m):
    m[0]._parameters["bias"] = None


def _remove_slot(m):
    del m[0]._parameters["bias"]


def _fill_empty_slot(m):
    m[1][1].register_parameter("bias", None)  # listed as an empty slot below, then filled


@pytest.mark.parametrize("change", [_hook, _pre_hook, _swap_children, _reinsert_same_child, _add_child,
                                    _remove_child, _replace_parameter, _new_storage, _set_storage, _empty_slot,
                                    _remove_slot])
def test_a_change_is_never_answered_unchanged(change, unchanged):
    model = _model()
    args = _args(model)
    assert unchanged(args) == 1
    change(model)
    assert unchanged(args) == 0


def test_an_empty_slot_filled_is_a_change(unchanged):
    model = _model()
    _fill_empty_slot(model)
    args = _args(model)
    assert unchanged(args) == 1 and None in args[5]
    model[1][1].bias = torch.nn.Parameter(torch.zeros(2))
    assert unchanged(args) == 0


def test_in_place_updates_and_other_models_are_not_changes(unchanged):
    """A replay reads the parameters' memory, so values written in place need no new graph."""
    model = _model()
    args = _args(model)
    with torch.no_grad():
        model[0].weight.mul_(2)
    _model().register_forward_hook(lambda *a: None)
    assert unchanged(args) == 1


def test_arguments_of_another_shape_answer_changed(unchanged):
    model = _model()
    args = _args(model)
    assert unchanged(args[:7]) == 0
    assert unchanged(args + ([],)) == 0
    assert unchanged(tuple(args[:2]) + (tuple(args[2]),) + tuple(args[3:])) == 0  # a tuple where a list was
    assert unchanged((args[0] + [[]],) + args[1:]) == 0  # a list where a dict was
    assert unchanged(args[:3] + (args[3], args[4][:-1], args[5])) == 0  # keys shorter than dicts
    assert unchanged(args[:2] + (args[2][:-1],) + args[3:]) == 0  # fewer children listed than the dicts hold
    assert unchanged(args[:2] + (args[2] + [None],) + args[3:]) == 0  # more
    assert unchanged(args[:7] + (args[7][:-1],)) == 0  # fewer addresses than tensors
    assert unchanged(args[:7] + ([str(a) for a in args[7]],)) == 0  # an address that is not an int
    assert unchanged(args[:6] + ([object()] * len(args[6]), args[7])) == 0  # data_ptr raises: not a tensor
    assert unchanged(args) == 1


def test_an_address_listed_as_none_is_not_read(unchanged):
    """An opaque oneDNN tensor has no data pointer: listed as None, only its slot's identity counts."""
    model = _model()
    args = _args(model)
    args = args[:7] + ([None] + args[7][1:],)
    model[0].weight.data = model[0].weight.detach().clone()
    assert unchanged(args) == 1
    model[0].bias.data = model[0].bias.detach().clone()
    assert unchanged(args) == 0


def test_hook_dicts_that_are_ordered_dicts_count_when_not_empty(unchanged):
    args = _args(_model())
    extra = OrderedDict()
    assert unchanged(([*args[0], extra],) + args[1:]) == 1
    extra[0] = print
    assert unchanged(([*args[0], extra],) + args[1:]) == 0


def test_a_free_threaded_python_keeps_the_python_check(monkeypatch):
    """The C pass reads dicts through borrowed references: without the GIL another thread could
    free them under it, so a free-threaded build never loads it."""
    monkeypatch.setattr(model_check, "_FREE_THREADED", True)
    monkeypatch.delenv(model_check.ENV_SWITCH, raising=False)
    assert model_check.load() is None
    assert "free-threaded" in model_check.unavailable_reason() and model_check.describe().startswith("Python")


@pytest.fixture(scope="module")
def hold():
    tensor_data_or_skip()
    return model_check.hold


def _held(model, hold) -> tuple:
    """The eight lists and the hold's ninth item, as the graph runner passes them with the C++ reader."""
    args = _args(model)
    h = hold(args[6], args[7])
    return args + (h.check,), h


def _resize_storage(m):  # the same TensorImpl and storage object, the storage's memory moved
    m[0].weight.untyped_storage().resize_(1024)


@pytest.mark.parametrize("change", [_replace_parameter, _new_storage, _set_storage, _resize_storage, _hook,
                                    _swap_children, _remove_slot])
def test_with_a_hold_the_addresses_are_read_from_the_tensorimpls(change, unchanged, hold):
    """The ninth item answers the address part in place of a data_ptr call per tensor: a tensor
    whose data moved (new storage, set_, a storage resize) is a change, as every other kind is."""
    model = _model()
    args, h = _held(model, hold)
    assert unchanged(args) == 1
    change(model)
    assert unchanged(args) == 0


def test_with_a_hold_in_place_updates_are_not_changes(unchanged, hold):
    model = _model()
    args, h = _held(model, hold)
    with torch.no_grad():
        model[0].weight.mul_(2)
        model[1][1].bias.zero_()
    assert unchanged(args) == 1


def test_a_ninth_item_that_is_not_a_hold_answers_changed(unchanged, hold):
    model = _model()
    args, h = _held(model, hold)
    fn, held = h.check
    for bad in ([], (fn,), (fn, held, 0), (str(fn), held), (fn, None), (0, held), (fn, 0), (fn, -1 << 70)):
        assert unchanged(args[:8] + (bad,)) == 0, bad
    assert unchanged(args) == 1


def test_a_held_tensor_cannot_be_swapped_away_and_the_hold_lets_go_when_freed(unchanged, hold):
    """The hold keeps a weak reference to each TensorImpl (its memory stays valid for the check);
    torch.utils.swap_tensors refuses a tensor with one, loudly, rather than move it under a graph.
    Freed, the hold gives the references back: the same swap then goes through."""
    model = _model()
    args, h = _held(model, hold)
    other = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(RuntimeError):
        torch.utils.swap_tensors(model[0].weight, other)
    assert unchanged(args) == 1
    del args, h
    torch.utils.swap_tensors(model[0].weight, other)
    assert torch.equal(model[0].weight, torch.zeros(4, 4))


def test_a_hold_refuses_tensors_and_addresses_of_different_lengths(hold):
    model = _model()
    args = _args(model)
    with pytest.raises(ValueError, match="tensors but"):
        hold(args[6], args[7][:-1])


def test_without_a_cpp_compiler_there_is_no_hold_and_the_log_says_data_ptr(monkeypatch):
    """No C++ compiler: ``hold`` gives None (the engine's C pass then calls data_ptr) and the
    startup line says so, naming why."""
    native_or_skip(model_check, "the C model check")
    from minivllm.layers import native_build
    lib = native_build.NativeLibrary(model_check.TENSOR_DATA_SOURCE, model_check.ENV_SWITCH,
                                     model_check._wrap_tensor_data, torch_api=True)
    monkeypatch.setattr(model_check, "_tensor_data", lib)
    c_compilers = native_build._compilers
    monkeypatch.setattr(native_build, "_compilers", lambda cxx=False: [] if cxx else c_compilers())
    monkeypatch.delenv(model_check.ENV_SWITCH, raising=False)
    model = _model()
    args = _args(model)
    assert model_check.hold(args[6], args[7]) is None
    line = model_check.describe()
    assert "through Tensor.data_ptr" in line and "no C++ compiler found" in line
