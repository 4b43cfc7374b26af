"""``kvserve bench structured``: JSON-schema requests with and without guided decoding.

Each prompt asks for a JSON object and shows its schema. Measured: the share of outputs that parse and
validate against the schema without and with the constraint, and the constraint's cost, the output tokens/s
of one batch with half its requests constrained against the same batch unconstrained, with the mean time per
engine step spent filling the grammar masks.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass

from kvserve.core.engine import LLMEngine
from kvserve.sampling.sampling_params import SamplingParams
from kvserve.structured import GuidedDecodingParams

_TEXT = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}


def _obj(required: list[str], **props: dict) -> dict:
    return {"type": "object", "properties": props, "required": required}


SCHEMAS = {
    "person": _obj(["name", "age", "city"], name=_TEXT, age=_INT, city=_TEXT),
    "product": _obj(["name", "price", "in_stock"], name=_TEXT, price=_NUM, in_stock={"type": "boolean"}),
    "event": _obj(
        ["title", "date", "attendees"],
        title=_TEXT,
        date={"type": "string", "pattern": r"\d{4}-\d{2}-\d{2}"},
        attendees=_INT,
    ),  # fmt: skip
    "address": _obj(["street", "city", "postcode", "country"], street=_TEXT, city=_TEXT, postcode=_TEXT, country=_TEXT),
    "shopping list": _obj(["items"], items={"type": "array", "items": _TEXT, "minItems": 1, "maxItems": 5}),
    "review": _obj(
        ["sentiment", "stars"],
        sentiment={"enum": ["positive", "neutral", "negative"]},
        stars={"type": "integer", "minimum": 1, "maximum": 5},
    ),  # fmt: skip
    "measurement": _obj(
        ["temperature_c", "humidity_percent", "wind_kmh"],
        temperature_c=_NUM,
        humidity_percent={"type": "number", "minimum": 0, "maximum": 100},
        wind_kmh=_NUM,
    ),  # fmt: skip
}
SUBJECTS = {
    "person": ["a nurse from Lisbon aged 41", "a student in Tokyo who is 19", "a retired farmer from Iowa, 72",
               "a chef in Lyon aged 35", "a pilot from Nairobi, 50", "a painter in Mexico City aged 28",
               "a teacher from Oslo, 44"],
    "product": ["a red bicycle for 299.99 that is in stock", "a sold-out coffee grinder at 49.50",
                "noise-cancelling headphones for 199, available", "a desk lamp at 24.99, out of stock",
                "a hiking backpack for 89, in stock", "a cast-iron pan at 35.5, available",
                "a mechanical keyboard for 120, sold out"],
    "event": ["a jazz concert on 2025-06-14 with 300 guests", "a team meeting on 2024-11-02 for 8 people",
              "a wedding on 2026-05-30 with 120 attendees", "a marathon on 2025-04-21 with 5000 runners",
              "a book club on 2024-09-10 with 12 members", "a science fair on 2025-03-03 with 450 visitors",
              "a chess tournament on 2025-08-17 with 64 players"],
    "address": ["the Eiffel Tower in Paris", "a flat on Baker Street in London", "an office in Berlin Mitte",
                "a house in Toronto", "a shop in Melbourne", "a museum in Madrid", "a cafe in Rome"],
    "shopping list": ["a pancake breakfast", "a picnic", "a birthday party", "a week of vegetarian dinners",
                      "a camping trip", "cleaning the kitchen", "a taco night"],
    "review": ["a restaurant whose food was cold and late", "a phone that works perfectly",
               "a hotel that was fine but noisy", "a movie the writer loved", "a broken umbrella",
               "an average pair of shoes", "a wonderful museum visit"],
    "measurement": ["a hot humid day in Singapore", "a windy winter morning in Chicago", "a mild spring day in Paris",
                    "a dry afternoon in Phoenix", "a foggy evening in San Francisco", "a storm in Manila",
                    "a calm night in Reykjavik", "a rainy day in Seattle"],
}  # fmt: skip


def prompts(count: int) -> list[tuple[str, str]]:
    """(schema name, user message) pairs, cycling through the schemas."""
    pairs = [(name, subject) for name in SCHEMAS for subject in SUBJECTS[name]]
    pairs = sorted(pairs, key=lambda p: SUBJECTS[p[0]].index(p[1]))[:count]  # every schema early on
    return [
        (name, f"Describe {subject} as a {name}. Reply with only a JSON object that matches this JSON schema: "
               f"{json.dumps(SCHEMAS[name])}")
        for name, subject in pairs
    ]  # fmt: skip


@dataclass
class Run:
    label: str
    constrained: int  # requests in the batch with the schema as a constraint
    requests: int
    seconds: float
    output_tokens: int
    valid: int  # outputs that parse as they are and validate against their schema
    valid_unfenced: int  # the same after stripping a Markdown code fence around the JSON
    cut: int  # outputs that max_tokens ended (a constrained one is then valid JSON cut short)
    mask_steps: int
    mask_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self) -> dict:
        mean_mask_ms = 1000 * self.mask_seconds / self.mask_steps if self.mask_steps else 0.0
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "mean_mask_ms_per_step": mean_mask_ms}


def run_batch(engine: LLMEngine, items: list[tuple[str, list[int]]], constrain: list[bool], max_tokens: int) -> Run:
    """All requests at once (greedy); ``constrain[i]``: request i is guided by its schema."""
    import jsonschema

    mask_seconds, mask_steps = engine.guided_mask_seconds, engine.guided_mask_steps
    ids = {}
    for (name, prompt), guided in zip(items, constrain, strict=True):
        fmt = GuidedDecodingParams(json=SCHEMAS[name]) if guided else None
        params = SamplingParams(temperature=0, max_tokens=max_tokens, guided_decoding=fmt)
        ids[engine.add_request(prompt, params)] = name
    start, texts = time.perf_counter(), {}
    tokens = cut = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
                tokens += len(out.outputs[0].token_ids)
                cut += out.outputs[0].finish_reason == "length"
    seconds = time.perf_counter() - start
    checks = [(_valid(texts[i], SCHEMAS[name], jsonschema), _valid(_unfence(texts[i]), SCHEMAS[name], jsonschema))
              for i, name in ids.items()]  # fmt: skip
    return Run(
        label="", constrained=sum(constrain), requests=len(items), seconds=seconds, output_tokens=tokens,
        valid=sum(a for a, _ in checks), valid_unfenced=sum(b for _, b in checks), cut=cut,
        mask_steps=engine.guided_mask_steps - mask_steps, mask_seconds=engine.guided_mask_seconds - mask_seconds,
    )  # fmt: skip


def _valid(text: str, schema: dict, jsonschema) -> bool:  # noqa: ANN001 - the jsonschema module
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _unfence(text: str) -> str:
    match = re.search(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    return match.group(1) if match else text.strip()


def markdown(report: dict) -> str:
    m = report["machine"]
    setup = (
        f"Model {report['model']}, dtype {report['dtype']}, {report['threads']} torch threads on {m['cpu']} "
        f"({m['nproc']} vCPU), torch {m['torch']}, xgrammar {report['xgrammar']}; {report['requests']} prompts, "
        f"greedy, max_tokens {report['max_tokens']}. Command: `{report['command']}`"
    )
    lines = [
        "# Structured output: JSON-schema requests with and without guided decoding", "", setup, "",
        "| batch | constrained | output tokens | seconds | tokens/s | valid JSON (as is) | valid after unfencing "
        "| cut by max_tokens | mask fill ms/step |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]  # fmt: skip
    for r in report["runs"]:
        lines.append(
            f"| {r['label']} | {r['constrained']}/{r['requests']} | {r['output_tokens']} | {r['seconds']:.1f} "
            f"| {r['tokens_per_s']:.1f} | {r['valid'] / r['requests']:.0%} | {r['valid_unfenced'] / r['requests']:.0%} "
            f"| {r['cut']} | {r['mean_mask_ms_per_step']:.2f} |"
        )
    s = report["summary"]
    lines += [
        "",
        f"- Outputs that parse and validate: **{s['valid_without']:.0%} without** the constraint, "
        f"**{s['valid_with']:.0%} with** it; with it, every output that the grammar completed (not cut by "
        f"max_tokens) validates: {s['valid_with_completed']:.0%}.",
        f"- Half the batch constrained runs at **{s['half_vs_none_tokens_per_s']:.2f}x** the output tokens/s of "
        f"the same batch unconstrained; filling the grammar masks takes {s['mask_ms_per_step']:.2f} ms per step "
        f"on average ({report['dtype']}, {report['threads']} threads).",
        "",
    ]
    return "\n".join(lines)
