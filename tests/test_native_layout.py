"""The ctypes mirrors of kernels.h's structs (kernels/native/__init__.py) against the compiled library: every
struct's size and every field's offset as the C compiler lays them out, and the same fields on both sides. A
field added, moved or retyped on one side only would otherwise make the kernels read the wrong bytes, silently."""

import ctypes

import pytest

from fairseq_plugins.kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels could not be built here")


def c_name(field: str) -> str:
    return field.rstrip("_")  # ``in_``: ``in`` is a Python keyword


def test_every_struct_the_module_defines_is_checked():
    mirrors = {value for value in vars(native).values()
               if isinstance(value, type) and issubclass(value, ctypes.Structure)}
    assert mirrors == set(native.STRUCTS.values())


@pytest.mark.parametrize("name", sorted(native.STRUCTS))
def test_a_mirror_has_the_compiled_size_fields_and_offsets(name):
    mirror, compiled = native.STRUCTS[name], native.struct_layout()[name]
    assert ctypes.sizeof(mirror) == compiled[None], f"sizeof({name})"
    offsets = {c_name(field): getattr(mirror, field).offset for field, _ in mirror._fields_}
    assert offsets == {field: offset for field, offset in compiled.items() if field is not None}
