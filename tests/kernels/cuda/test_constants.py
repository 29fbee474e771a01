"""Scalar kernel parameters in the template (kernels.constants): the bits, and that every
source reads them through the switch."""

from __future__ import annotations

import re
import struct

import pytest

from tandem.kernels.cuda import constants
from tandem.kernels.cuda import decode_attention_cuda as dac
from tandem.kernels.cuda import paged_attention_cuda as pac
from tandem.kernels.cuda import qgemv as qg
from tandem.kernels.cuda import quantized_matmul as qmm


@pytest.mark.parametrize("x", [1e-5, 1e-6, 128 ** -0.5, 0.125, 1.0])
def test_float_bits_read_back_as_the_float32(x):
    bits = constants.float_bits(x)
    assert isinstance(bits, int) and 0 < bits < 2 ** 31   # a positive template int
    assert struct.unpack("<f", struct.pack("<i", bits))[0] == pytest.approx(x, rel=1e-7)
    assert constants.float_bits(x) != constants.float_bits(x * (1 + 1e-6))


def test_off_every_value_shares_one_kernel():
    """Off, the template carries zeros: two eps or scales compile one kernel, as before."""
    assert constants.eps_template(1e-5, False) == constants.eps_template(1e-6, False) == [("CONSTS", False),
                                                                                        ("EPS_BITS", 0)]
    assert constants.attention_template(0.1, 64, False) == constants.attention_template(0.2, 128, False)


def test_on_the_values_travel_in_the_template():
    assert constants.eps_template(1e-5, True) == [("CONSTS", True), ("EPS_BITS", constants.float_bits(1e-5))]
    assert dict(constants.attention_template(0.125, 96, True)) == {
        "CONSTS": True, "PART_C": 96, "SCALE_BITS": constants.float_bits(0.125)}


@pytest.mark.parametrize("source,array", [
    (qg._STREAM_SOURCE, "fparams"), (qmm._SOURCE, "fparams"),
    (pac._ATT_SOURCE, "params"), (pac._ATT_TILE_SOURCE, "params"), (pac._ATT_TC_SOURCE, "params"),
    (dac._SOURCE, "params"), *((s, "params") for s in dac._TILE_WRITE_SOURCES.values())])
def test_every_read_of_the_array_goes_through_the_switch(source, array):
    """A read of the parameter array outside ``CONSTS ? ... : array[i]`` would keep a
    scalar-pool read with the setting on."""
    reads = re.findall(rf"\b{array}\[\d\]", source)
    switched = re.findall(rf"CONSTS \? [^:;]+ : (?:\(int\))?{array}\[\d\]", source)
    assert reads and len(switched) == len(reads), (reads, switched)
