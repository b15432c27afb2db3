"""LLM.chat with vLLM's arguments: tools, chat_template(_kwargs), continue_final_message, add_generation_prompt,
chat_template_content_format, tokenization_kwargs; the rendered prompt comes back as RequestOutput.prompt."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.entrypoints.chat_utils import resolve_content_format

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
# Writes what a template can see, so a test can say what the prompt must be.
PROBE = ("{% for m in messages %}<{{ m['role'] }}:{{ m['content'] }}>{% endfor %}"
         "{% if tools %}tools={{ tools | map(attribute='function') | map(attribute='name') | join(',') }}{% endif %}"
         "|{{ flavour | default('none') }}{% if add_generation_prompt %}<assistant:{% endif %}")
# Reads content as a list of parts (as multimodal templates do).
PARTS = "{% for m in messages %}{% for part in m['content'] %}[{{ part['text'] }}]{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256)


def test_the_rendered_prompt_is_the_outputs_prompt(llm):
    (output,) = llm.chat(MESSAGES, PARAMS, use_tqdm=False)
    rendered = llm.get_tokenizer().apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert output.prompt == rendered
    assert output.prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)


def test_tools_template_and_its_kwargs_reach_the_template(llm):
    (output,) = llm.chat(MESSAGES, PARAMS, use_tqdm=False, chat_template=PROBE, tools=TOOLS,
                         chat_template_kwargs={"flavour": "vanilla"})
    assert output.prompt == "<user:What is 2+2?>tools=get_weather|vanilla<assistant:"
    (plain,) = llm.chat(MESSAGES, PARAMS, use_tqdm=False, chat_template=PROBE, add_generation_prompt=False)
    assert plain.prompt == "<user:What is 2+2?>|none"


def test_continue_final_message_continues_the_last_one(llm):
    messages = MESSAGES + [{"role": "assistant", "content": "It is"}]
    (output,) = llm.chat(messages, PARAMS, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert output.prompt.endswith("It is")
    token_ids = llm.get_tokenizer().encode(output.prompt, add_special_tokens=False)
    expected = llm.generate([{"prompt_token_ids": token_ids}], PARAMS, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == expected.outputs[0].token_ids
    with pytest.raises(ValueError, match="add_generation_prompt=false"):
        llm.chat(messages, PARAMS, use_tqdm=False, continue_final_message=True)


def test_content_formats(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    (as_string,) = llm.chat(parts, PARAMS, use_tqdm=False, chat_template=PROBE, add_generation_prompt=False,
                            chat_template_content_format="string")
    assert as_string.prompt == "<user:a\nb>|none"
    (as_parts,) = llm.chat(parts, PARAMS, use_tqdm=False, chat_template=PARTS, chat_template_content_format="openai")
    assert as_parts.prompt == "[a][b]"
    # "auto" sees that PARTS loops over the content, and hands a plain string over as one part.
    (auto,) = llm.chat(MESSAGES, PARAMS, use_tqdm=False, chat_template=PARTS)
    assert auto.prompt == "[What is 2+2?]"
    tokenizer = llm.get_tokenizer()
    assert resolve_content_format("auto", PARTS, tokenizer) == "openai"
    assert resolve_content_format("auto", PROBE, tokenizer) == "string"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mm_processor_kwargs": {"num_crops": 4}}, "text-only"),
    ({"lora_request": object()}, "LoRA"),
    ({"chat_template_content_format": "xml"}, "allowed"),
    ({"chat_template_kwargs": {"tokenize": True}}, "tokenize"),
    ({"tokenization_kwargs": {"truncation": True}}, "add_special_tokens"),
])
def test_what_it_cannot_do_is_a_value_error(llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(MESSAGES, PARAMS, use_tqdm=False, **kwargs)


def test_priority_goes_to_generate(llm):
    with pytest.raises(ValueError, match="priority=3 needs the priority scheduling policy"):
        llm.chat(MESSAGES, PARAMS, use_tqdm=False, priority=3)
    assert len(llm.chat([MESSAGES, MESSAGES], PARAMS, use_tqdm=False, priority=[0, 0])) == 2
