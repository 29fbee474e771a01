"""bench/_common.py: the grouped-bar SVG (one bar per value, heights proportional to the values) and the HTTP body reader."""

import importlib.util
import math
import xml.etree.ElementTree as ET
from pathlib import Path

_spec = importlib.util.spec_from_file_location("bench_common", Path(__file__).resolve().parents[1] / "bench" / "_common.py")
bench_common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_common)

NS = "{http://www.w3.org/2000/svg}"


def bars(svg: str) -> list[dict]:
    """The data bars (legend swatches are the 12x12 squares)."""
    root = ET.fromstring(svg)  # also checks the document is well-formed XML
    return [r.attrib for r in root.iter(NS + "rect") if r.attrib["width"] != "12"]


def texts(svg: str) -> list[str]:
    return [t.text for t in ET.fromstring(svg).iter(NS + "text")]


def test_one_bar_per_value_with_heights_proportional_to_values():
    series = [("a & b", "#111111", [10.0, 20.0, 40.0]), ("c <d>", "#222222", [5.0, 0.0, 30.0])]
    svg = bench_common.bar_chart_svg("t & <title>", ["g1", "g2", "g3"], series, ["1x", "2x", "3x"], y_label="tok/s")
    drawn = bars(svg)
    assert len(drawn) == 6
    values = [vs[i] for i in range(3) for _, _, vs in series]  # drawn group by group
    assert [d["fill"] for d in drawn] == ["#111111", "#222222"] * 3
    scale = float(drawn[4]["height"]) / 40.0
    for d, v in zip(drawn, values):
        assert math.isclose(float(d["height"]), v * scale, abs_tol=0.1)
        # Bars stand on the same baseline.
        assert math.isclose(float(d["y"]) + float(d["height"]), float(drawn[0]["y"]) + float(drawn[0]["height"]), abs_tol=0.11)
    # Bars in a group sit side by side; groups go left to right.
    xs = [float(d["x"]) for d in drawn]
    assert xs == sorted(xs)
    assert {"t & <title>", "a & b", "c <d>", "tok/s", "1x", "2x", "3x", "g1", "g2", "g3"} <= set(texts(svg))


def test_missing_values_draw_no_bar_and_annotation_sits_over_the_tallest_bar():
    series = [("a", "#111111", [3.0, None]), ("b", "#222222", [6.0, float("nan")]), ("c", "#333333", [1.0, 2.0])]
    svg = bench_common.bar_chart_svg("t", ["x", "y"], series, ["over x", ""])
    drawn = bars(svg)
    assert [d["fill"] for d in drawn] == ["#111111", "#222222", "#333333", "#333333"]
    root = ET.fromstring(svg)
    note = next(t for t in root.iter(NS + "text") if t.text == "over x")
    assert math.isclose(float(note.attrib["y"]), float(drawn[1]["y"]) - 4, abs_tol=0.11)
    assert "" not in texts(svg) and None not in texts(svg)


def test_all_zero_values_still_render():
    svg = bench_common.bar_chart_svg("t", ["x"], [("a", "#111111", [0.0])])
    assert [float(d["height"]) for d in bars(svg)] == [0.0]


class _Engine:
    def tick(self):
        return "class"


def test_patches_put_back_own_attributes_and_delete_the_ones_a_class_showed():
    eng = _Engine()
    eng.read_back = lambda: "own"
    holder = type("Module", (), {})()
    holder.async_eval = len  # a module attribute: the object's own
    patches = bench_common.Patches()
    assert patches.wrap(eng, "tick", lambda fn: lambda: "wrapped " + fn()).__func__ is _Engine.tick
    assert patches.patch(eng, "read_back", lambda: "patched")() == "own"
    patches.wrap(holder, "async_eval", lambda fn: lambda x: fn(x) + 1)
    patches.wrap(holder, "async_eval", lambda fn: lambda x: fn(x) * 10)  # twice: unwinds in order
    assert (eng.tick(), eng.read_back(), holder.async_eval("ab")) == ("wrapped class", "patched", 30)
    patches.undo()
    assert "tick" not in vars(eng) and eng.tick() == "class"
    assert eng.read_back() == "own" and holder.async_eval is len
    patches.undo()  # a second undo has nothing left to put back
    assert eng.read_back() == "own"


def _body(raw: bytes, headers: dict) -> bytes:
    import asyncio

    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return b"".join([c async for c in bench_common.http_body_chunks(reader, headers)])

    return asyncio.run(run())


def test_http_body_chunks_decodes_chunked_sized_and_to_eof_bodies_and_refuses_a_cut_one():
    import pytest

    assert _body(b"3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n", {"transfer-encoding": "chunked"}) == b"abcde"
    assert _body(b"hello, and more", {"content-length": "5"}) == b"hello"
    assert _body(b"to the end", {}) == b"to the end"
    with pytest.raises(ConnectionResetError, match="inside a chunked body"):
        _body(b"3\r\nabc\r\n", {"transfer-encoding": "chunked"})  # closed before the last chunk


def test_sse_data_yields_each_data_payload_across_chunk_boundaries():
    import asyncio

    body = b'data: {"a": 1}\n\n: comment\ndata: {"b"' + b': 2}\n\nevent: x\ndata: [DONE]\n\n'
    # Chunked so that one event is split across two chunks.
    raw = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:20], body[20:])) + b"0\r\n\r\n"

    async def run():
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return [p async for p in bench_common.sse_data(reader, {"transfer-encoding": "chunked"})]

    assert asyncio.run(run()) == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]
