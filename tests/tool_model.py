"""Tiny models trained (in seconds) to call a tool the way a chat template's family does.

A random model never calls a tool; these learn a few conversations by heart: asked for the
weather they answer with a call (Hermes ``<tool_call>`` blocks, or Llama 3's bare JSON),
shown the tool's result they answer in words. The templates are written here in the two
families' formats; the call markers of the Hermes model are special tokens, as in Qwen's
tokenizer (so a server that skipped special tokens would never see them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from tests.tiny import make_tiny_model

HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call these functions:\\n<tools>' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall one as <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n"
    "</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content }}"
    "{{- '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- if m.content %}{{- '\\n' + m.content }}{%- endif %}"
    "{%- for c in m.tool_calls %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{{- (c.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nAnswer a call as JSON {\"name\": ..., "
    "\"parameters\": ...}. Functions:' }}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{- '<|im_start|>ipython\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
    "{%- for c in m.tool_calls %}"
    "{{- '{\"name\": \"' + c.function.name + '\", \"parameters\": ' }}"
    "{{- (c.function.arguments | tojson) + '}' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER, TIME]

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_TWO = [{"role": "user", "content": "Weather in Paris and in Rome?"}]
CALL_ID = "call-1"
RESULT = "It is 21 degrees and sunny in Paris."
HELLO = [{"role": "user", "content": "Hello!"}]
HELLO_ANSWER = "Hello, how can I help?"


def calls_message(*cities: str) -> dict[str, Any]:
    """The assistant turn that asked for the weather of ``cities`` (the OpenAI shape, as a
    client sends it back)."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call-{i + 1}", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": c})}}
            for i, c in enumerate(cities)
        ],
    }


Lesson = tuple[list[dict[str, Any]], Any, str]  # messages, tools, the answer to learn

# verifiers' task (tests/verifiers_task.py): its tool as verifiers describes the Python
# function to the server, and the conversation its chat harness sends
VERIFIERS_QUESTION = "What is the weather in Paris?"
VERIFIERS_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"title": "City", "type": "string"}},
            "required": ["city"],
            "title": "get_weatherArguments",
        },
    },
}
VERIFIERS_ANSWER = "It is sunny in Paris."


def verifiers_lessons(family: str) -> list[Lesson]:
    ask = [{"role": "user", "content": VERIFIERS_QUESTION}]
    result = {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather",
              "content": "The weather in Paris is sunny, 22C."}
    return [
        (ask, [VERIFIERS_TOOL], FAMILIES[family].call_text("Paris")),
        ([*ask, calls_message("Paris"), result], [VERIFIERS_TOOL], VERIFIERS_ANSWER),
    ]


def answered() -> list[dict[str, Any]]:
    """The conversation after the call: the call, then the tool's result."""
    return [*ASK, calls_message("Paris"),
            {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp": 21, "sky": "sunny"}'}]


@dataclass(frozen=True)
class Family:
    """A chat template (its text, or the name of a real one TRL ships), the tool-call format it
    shows, the tokens it needs (special: skipped in text unless asked for; added: plain
    text, as Qwen's ``<tool_call>``) and its end-of-turn token."""

    template: str
    fmt: str  # hermes | llama3_json
    specials: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    eos: str = "<|im_end|>"
    real: bool = False  # template names a file of trl/chat_templates

    def template_text(self) -> str:
        if not self.real:
            return self.template
        import trl

        return (Path(trl.__file__).parent / "chat_templates" / self.template).read_text()

    def call_text(self, *cities: str) -> str:
        if self.fmt == "hermes":
            return "\n".join(
                '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps({"city": c})
                + "}\n</tool_call>" for c in cities
            )
        return "; ".join(
            '{"name": "get_weather", "parameters": ' + json.dumps({"city": c}) + "}"
            for c in cities
        )


LLAMA_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>")
FAMILIES = {
    "hermes": Family(HERMES_TEMPLATE, "hermes", specials=("<tool_call>", "</tool_call>")),
    "llama3_json": Family(LLAMA_TEMPLATE, "llama3_json"),
    # the real templates of the two families, as their tokenizers ship them
    "qwen2_5": Family("qwen2_5.jinja", "hermes", added=("<tool_call>", "</tool_call>"),
                      real=True),
    "llama3_2": Family("llama3_2.jinja", "llama3_json", specials=LLAMA_SPECIALS,
                       eos="<|eot_id|>", real=True),
}


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """As the server hands messages to a template: call arguments as objects."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"],
                                   "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def render(tok: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
           ) -> list[int]:
    text = tok.apply_chat_template(_template_messages(messages), tools=tools, tokenize=False,
                                   add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


def make_tool_model(out: Path, family: str, extra: list[Lesson] | None = None,
                    steps: int = 800) -> Path:
    """A tiny model (fp32) that answers the lessons below (and ``extra``) greedily, letter
    for letter."""
    fam = FAMILIES[family]
    make_tiny_model(out, "llama", seed=0)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": list(fam.specials)})
    tok.add_tokens(list(fam.added))
    tok.chat_template = fam.template_text()
    tok.eos_token = fam.eos
    lessons = [
        (ASK, TOOLS, fam.call_text("Paris")),
        (ASK_TWO, TOOLS, fam.call_text("Paris", "Rome")),
        (answered(), TOOLS, RESULT),
        (HELLO, None, HELLO_ANSWER),
        *(extra or []),
    ]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    eos = tok.convert_tokens_to_ids(fam.eos)
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    seqs = []
    for messages, tools, answer in lessons:
        prompt = render(tok, messages, tools)
        target = list(tok.encode(answer, add_special_tokens=False)) + [eos]
        seqs.append((torch.tensor([prompt + target]), len(prompt)))
    _learn(model, seqs, steps)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _learn(model: Any, seqs: list[tuple[torch.Tensor, int]], steps: int) -> None:
    """Adam on the answers' tokens until every answer token is the argmax by a clear margin
    (greedy decoding then writes them); fails if that is not reached."""
    torch.manual_seed(0)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        margins = []
        for ids, start in seqs:
            logits = model(ids).logits[0, start - 1 : -1]  # [answer, vocab]
            target = ids[0, start:]
            torch.nn.functional.cross_entropy(logits, target).backward()
            top2 = logits.detach().topk(2, dim=-1)
            right = logits.detach().gather(1, target[:, None])[:, 0]
            other = torch.where(top2.indices[:, 0] == target, top2.values[:, 1], top2.values[:, 0])
            margins.append(float((right - other).min()))
        if min(margins) > 3.0:
            model.eval()
            return
        opt.step()
    raise AssertionError(f"the tool model did not learn its lessons (margins {margins})")
