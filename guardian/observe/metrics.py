"""Turn a vLLM /metrics page into a VllmSample, with prometheus_client's parser.

Only the lines of the few series guardian reads are parsed: one linear pass over the page picks
them (by exact series name), each at most MAX_LINE_BYTES and all together at most
MAX_SELECTED_BYTES, and prometheus_client parses just those. A real vLLM 0.32 page is 51 KB with
about 600 samples, of which guardian needs about 15 lines: parsing it whole was half of guardian's
CPU at idle. And the parser is quadratic on some inputs (a label value made of escapes: 1 MiB took
6.6 s of a core), so what it is given must be bounded in size, not only the page.

The page of every tick takes a shorter road to the same sample (parse_vllm_page): the wanted lines
are found by searching for their names at line starts (no pass in Python over the other ~1,150
lines), and lines of the plain shape vLLM writes (``name{label="value",...} number``) are read with
one regular expression each instead of prometheus_client's character-by-character label parser
(about 1.4 ms of the 1.6 ms a page took, most of it on vllm:cache_config_info's 36 labels). Any
page where the short road could differ (a line of another shape, a bound passed or near) goes the
long road above, so both give the same sample, or the same error, for every page.

Values are summed over label sets (several engines, finished reasons). A page that does not
parse, or that lacks the gauges guardian judges progress by, raises MetricsError: guardian
then cannot tell busy from stalled and must not restart on that replica's metrics.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Iterable, Mapping

from prometheus_client.parser import text_string_to_metric_families

from ..core.memory.wiring import parse_fraction
from ..core.observations import VllmSample
from ..engines.base import PageShape
from ..engines.vllm import PAGE as VLLM


class MetricsError(ValueError):
    pass


# A real vLLM 0.32 page has about 600 samples (vllm_sim/data); a page with many more is not one
# guardian should spend its tick on.
MAX_SAMPLES = 20_000
MAX_LINES = 4 * MAX_SAMPLES  # with its # HELP and # TYPE lines, and some blank ones
MAX_MODEL_NAMES = 16
# The longest line guardian reads on a real page is vllm:cache_config_info's (36 labels, 1 KiB).
MAX_LINE_BYTES = 16 * 2**10
# About 15 lines on a real page (a few engines or finished reasons more on a big server).
MAX_SELECTED_BYTES = 256 * 2**10
MAX_BUCKETS = 64


def select_lines(page: bytes, shape: PageShape = VLLM) -> str:
    """The sample lines of PAGE whose series guardian reads, as text for the parser.

    Linear in the page's size. Comments (# HELP, # TYPE) are dropped: without them each kept
    sample is an untyped family of its own name, which is all guardian reads. Raises
    MetricsError on a page with more than MAX_SAMPLES samples, or a wanted line longer than
    MAX_LINE_BYTES, or more than MAX_SELECTED_BYTES of them.
    """
    kept: list[bytes] = []
    lines = samples = kept_bytes = 0
    for raw in io.BytesIO(page):  # one line at a time: a page of 2M empty lines is not 2M objects
        lines += 1
        if lines > MAX_LINES:
            raise MetricsError(f"more than {MAX_LINES} lines on the page")
        line = raw.rstrip(b"\n")
        if not line or line.startswith(b"#"):
            continue
        samples += 1
        if samples > MAX_SAMPLES:
            raise MetricsError(f"more than {MAX_SAMPLES} samples on the page")
        if not line.startswith(shape.wanted_prefixes):
            continue
        name = line.split(b"{", 1)[0].split(b" ", 1)[0]
        if name not in shape.wanted_names:
            continue  # a longer name with a wanted prefix (vllm:num_requests_waiting_by_reason)
        shown = name.decode("ascii", "replace")
        if len(line) > MAX_LINE_BYTES:
            raise MetricsError(f"a {shown} line of {len(line)} bytes (at most {MAX_LINE_BYTES} are read)")
        kept_bytes += len(line) + 1
        if kept_bytes > MAX_SELECTED_BYTES:
            raise MetricsError(f"more than {MAX_SELECTED_BYTES} bytes of the series guardian reads")
        kept.append(line)
    kept.append(b"")
    return b"\n".join(kept).decode("utf-8", errors="replace")


def parse_page(page: bytes, shape: PageShape) -> VllmSample:
    """The VllmSample of a whole /metrics page as it came from the replica: what
    parse_metrics(select_lines(PAGE, SHAPE), SHAPE) gives, or raises, by a shorter road where it can."""
    lines = _wanted_lines(page, shape)
    if lines is None:
        return parse_metrics(select_lines(page, shape), shape)
    text = b"\n".join([*lines, b""]).decode("utf-8", errors="replace")  # select_lines(page), as it gives it
    samples = _plain_samples(text)
    return parse_metrics(text, shape) if samples is None else _sample_of(samples, shape)


def parse_metrics(text: str, shape: PageShape) -> VllmSample:
    """The VllmSample of Prometheus text (a whole page, or select_lines' lines), with prometheus_client."""
    return _sample_of(
        ((s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples),
        shape,
    )


def parse_vllm_page(page: bytes) -> VllmSample:
    return parse_page(page, VLLM)


def parse_vllm_metrics(text: str) -> VllmSample:
    return parse_metrics(text, VLLM)


# --- the short road (parse_vllm_page) -----------------------------------------------------------


def _wanted_lines(page: bytes, shape: PageShape = VLLM) -> list[bytes] | None:
    """The lines select_lines keeps, in the page's order; None where select_lines could raise (a
    page of MAX_SAMPLES lines or more, a wanted line or all of them over their bounds): that is for
    select_lines itself to say."""
    if page.count(b"\n") >= MAX_SAMPLES:  # fewer lines than MAX_SAMPLES: neither count can pass its cap
        return None
    first_line, next_lines = shape.line_patterns
    first = first_line.match(page)
    lines: list[bytes] = next_lines.findall(page)
    if first is not None:
        lines.insert(0, first.group())
    if any(len(line) > MAX_LINE_BYTES for line in lines) or sum(len(x) + 1 for x in lines) > MAX_SELECTED_BYTES:
        return None
    return lines


# A sample line of the plain shape: a wanted name, optionally labels (each a legacy label name that
# is not reserved, "=", a quoted value with backslash escapes; separated by single commas), one
# space, a number-like word, nothing more. prometheus_client reads such a line as this does.
_VALUE = r'"[^"\\]*(?:\\.[^"\\]*)*"'  # unrolled: (?:[^"\\]|\\.)* is twice as slow on a 1 KiB line
_LABEL = rf"(?!__)[A-Za-z_][0-9A-Za-z_]*={_VALUE}"
_PLAIN = re.compile(rf"([^{{ ]+)(?:\{{({_LABEL}(?:,{_LABEL})*)\}})? ([0-9A-Za-z.+-]+)")
_LABELS = re.compile(r'([A-Za-z_][0-9A-Za-z_]*)="([^"\\]*(?:\\.[^"\\]*)*)"')
_INTEGER = re.compile(r"[+-]?[0-9]+")  # the words of _PLAIN's that int() takes
_ESCAPE = re.compile(r'\\[\\n"]')  # what prometheus_client unescapes in a label value
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


def _plain_samples(text: str) -> list[tuple[str, dict[str, str], float]] | None:
    """Each line of TEXT (select_lines' lines) as (name, labels, value), as prometheus_client reads
    it; None if a line is not of the plain shape, or a label is given twice (prometheus_client's to say)."""
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.split("\n"):
        if not line:
            continue
        m = _PLAIN.fullmatch(line)
        if m is None:
            return None
        name, body, word = m.groups()
        try:
            # prometheus_client's order: an integer where int() takes it, else a float
            value: float = int(word) if _INTEGER.fullmatch(word) else float(word)
        except ValueError:
            return None
        labels: dict[str, str] = {}
        if body is not None:
            if "\\" in body:
                pairs = [(k, _ESCAPE.sub(_unescape, v)) for k, v in _LABELS.findall(body)]
            else:  # no escapes: no value holds a quote, so each '",' ends a label
                pairs = [(k, v) for k, _, v in (x.partition('="') for x in body[:-1].split('",'))]
            labels = dict(pairs)
            if len(labels) != len(pairs):
                return None
        out.append((name, labels, value))
    return out


def _unescape(m: re.Match[str]) -> str:
    return _UNESCAPED[m.group(0)]


# --- both roads ------------------------------------------------------------------------------------


def _sample_of(samples: Iterable[tuple[str, Mapping[str, str], float]], shape: PageShape) -> VllmSample:
    """The VllmSample of SAMPLES, (name, labels, value) each, read as SHAPE says; raises MetricsError."""
    values: dict[str, float] = {}
    buckets: dict[float, float] = {}
    models: set[str] = set()
    gpu_util: float | None = None
    started: float | None = None
    count = 0
    try:
        for name, labels, value in samples:
            count += 1
            if count > MAX_SAMPLES:
                raise MetricsError(f"more than {MAX_SAMPLES} samples on the page")
            field = shape.summed.get(name)
            if field is not None:
                if not math.isfinite(value) or value < 0:
                    raise MetricsError(f"{name} has an impossible value {value!r}")
                values[field] = values.get(field, 0.0) + value
                if "model_name" in labels and len(models) < MAX_MODEL_NAMES:
                    models.add(labels["model_name"][:256])
            elif name == "process_start_time_seconds" and math.isfinite(value):
                started = value if started is None else min(started, value)
            elif name == shape.prefill_bucket:
                _bucket(buckets, labels.get("le", ""), value, name)
            elif name == shape.fraction_series:
                # Anything but a finite number in (0, 1] is no fraction (never written to an env file).
                gpu_util = parse_fraction(labels.get(shape.fraction_label))
    except MetricsError:
        raise
    except Exception as e:  # noqa: BLE001 - the parser raises ValueError, IndexError, ... on garbage
        raise MetricsError(f"not Prometheus text: {e}") from None
    for field, total in values.items():
        if not math.isfinite(total):  # finite samples can still sum to inf (two of 1e308)
            raise MetricsError(f"the {field} samples add up to {total!r}")
    missing = [f for f in shape.required if f not in values]
    if missing:
        names = ", ".join(k for k, v in shape.summed.items() if v in missing)
        raise MetricsError(f"no {names} on the page ({shape.hint})")
    return VllmSample(
        running=values["running"],
        waiting=values["waiting"],
        kv_cache_usage=values.get("kv_cache_usage", 0.0),
        generation_tokens=values["generation_tokens"],
        prompt_tokens=values.get("prompt_tokens", 0.0),
        iteration_count=values.get("iteration_count", 0.0),
        iteration_sum=values.get("iteration_sum", 0.0),
        request_success=values.get("request_success", 0.0),
        gpu_memory_utilization=gpu_util,
        model_names=tuple(sorted(models)),
        process_start_time_s=started,
        prefill_buckets=tuple(sorted(buckets.items())),
    )


def _bucket(buckets: dict[float, float], le: str, count: float, series: str) -> None:
    """One bucket line of the prefill histogram, summed over engines; a bound or count that is not
    a number, or more than MAX_BUCKETS bounds, makes the page unreadable."""
    try:
        bound = float(le)
    except ValueError:
        raise MetricsError(f"{series} has a bound {le[:32]!r} that is not a number") from None
    if math.isnan(bound) or not math.isfinite(count) or count < 0:
        raise MetricsError(f"{series} has an impossible bucket {le[:32]!r} = {count!r}")
    if bound not in buckets and len(buckets) >= MAX_BUCKETS:
        raise MetricsError(f"{series} has more than {MAX_BUCKETS} buckets")
    buckets[bound] = buckets.get(bound, 0.0) + count
