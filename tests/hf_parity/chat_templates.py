"""Writes tests/data/chat_templates/: fixtures that hold trainkit's chat-data preparation to
Hugging Face transformers' `apply_chat_template(..., tokenize=True, return_dict=True,
return_assistant_tokens_mask=True)` on chat templates in the styles of six model families.

What it writes:

- `tokenizer.json`: one small byte-level BPE (about 400 tokens) trained on the first 20000
  characters of tinyshakespeare, with the special tokens all six families use (ChatML's,
  Llama 3's, Gemma's, Mistral's) and `<think>` / `</think>` as added tokens that are not
  special (as Qwen3 has them), so each tokenizes as one token.
- `conversations.jsonl`: the conversations, one `{"messages": [...]}` a line. Each is an
  optional system message, then user and assistant turns alternating, ending with an
  assistant turn, so every template takes every conversation.
- `S.json` for each style S in qwen2.5, qwen3, llama3, gemma, mistral, smollm2:
  `chat_template` (modelled on the family's real template, tool-calling branches left out,
  each assistant reply wrapped in `{% generation %}...{% endgeneration %}`), `bos_token`,
  `eos_token` (null where the family has none), and `rows`, one per conversation in order:
  `input_ids` and `assistant_masks` as `apply_chat_template` gives them with
  `add_generation_prompt=False`, and `text`, the rendered conversation
  (`tokenize=False`).

transformers marks a token in `assistant_masks` when its character offsets overlap a
`{% generation %}` span (so a token that straddles a block's edge is marked).

Needs transformers, tokenizers and jinja2 (not torch). Rerun from the repository root:

    python3 -m venv target/py-chat
    target/py-chat/bin/pip install transformers tokenizers jinja2
    target/py-chat/bin/python tests/hf_parity/chat_templates.py

It reads ../shared/data/tinyshakespeare.txt beside the repository (--text overrides).
The output is deterministic: running it twice writes identical files.
"""

import argparse
import json
import os
import sys

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "data", "chat_templates")

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
    "<s>", "</s>", "[INST]", "[/INST]",
]
# Qwen3's reasoning markers: added tokens, not special ones.
THINK_TOKENS = ["<think>", "</think>"]


# ---------------------------------------------------------------------------------------
# Templates. Each follows its family's real `chat_template` (tokenizer_config.json) with
# the tool-calling branches left out; the assistant's reply and its end-of-turn token are
# a `{% generation %}` block. Raw strings: `'\n'` inside them is a Jinja escape, as in the
# real templates.

# Qwen2.5-Instruct: ChatML, default system prompt when there is none.
QWEN25 = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- generation %}
            {{- message.content + '<|im_end|>' + '\n' }}
        {%- endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Qwen3: ChatML, no default system prompt; reasoning (`<think>...</think>` in the content,
# or `reasoning_content`) is kept only for assistant turns after the last user message.
QWEN3 = r"""{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- generation %}
            {%- if loop.index0 > ns.last_query_index %}
                {%- if loop.last or (not loop.last and reasoning_content) %}
                    {{- '<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
                {%- else %}
                    {{- content }}
                {%- endif %}
            {%- else %}
                {{- content }}
            {%- endif %}
            {{- '<|im_end|>\n' }}
        {%- endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

# Llama 3.1 Instruct: bos, a system header with the knowledge and (fixed) today dates,
# contents trimmed, each turn ended by <|eot_id|>.
LLAMA3 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
        {%- generation %}
            {{- message['content'] | trim + '<|eot_id|>' }}
        {%- endgeneration %}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Gemma 3 (text only): bos, the system text folded into the first user turn, the
# assistant's role written `model`, contents trimmed, each turn `<end_of_turn>\n`. The
# block ends at `<end_of_turn>`: the `\n` after it is not trained.
GEMMA = r"""{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if role == 'model' -%}
        {%- generation -%}
            {{ message['content'] | trim }}
            {{- '<end_of_turn>' }}
        {%- endgeneration -%}
        {{ '\n' }}
    {%- else -%}
        {{ message['content'] | trim }}
        {{- '<end_of_turn>\n' }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Mistral-7B-Instruct v0.1/v0.2 (the later revision that takes a system message): bos,
# ` [INST] ... [/INST]`, the system text folded into the first user turn, then
# ` ` + reply + eos. The space before the reply is outside the block.
MISTRAL = r"""{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' }}
        {%- generation %}
            {{- message['content'] + eos_token }}
        {%- endgeneration %}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# SmolLM2-Instruct: ChatML on one line with newlines inside the string literals, default
# system prompt when there is none.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' + '\n'}}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# (name, template, bos_token, eos_token), as each family's tokenizer sets them.
STYLES = [
    ("qwen2.5", QWEN25, None, "<|im_end|>"),
    ("qwen3", QWEN3, None, "<|im_end|>"),
    ("llama3", LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
    ("gemma", GEMMA, "<bos>", "<eos>"),
    ("mistral", MISTRAL, "<s>", "</s>"),
    ("smollm2", SMOLLM2, "<|im_start|>", "<|im_end|>"),
]


def sys_(text):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


CONVERSATIONS = [
    # 0: system, one turn.
    [sys_("You are a citizen of Rome. Answer briefly."),
     user("Before we proceed any further, hear me speak."),
     assistant("Speak, speak.")],
    # 1: no system, one turn.
    [user("You are all resolved rather to die than to famish?"),
     assistant("Resolved. resolved.")],
    # 2: no system, three turns.
    [user("First, you know Caius Marcius is chief enemy to the people."),
     assistant("We know't, we know't."),
     user("Let us kill him, and we'll have corn at our own price. Is't a verdict?"),
     assistant("No more talking on't; let it be done: away, away!"),
     user("One word, good citizens."),
     assistant("We are accounted poor citizens, the patricians good.")],
    # 3: system, two turns, a reply of several lines.
    [sys_("Speak as in the play."),
     user("Would you proceed especially against Caius Marcius?"),
     assistant("Against him first: he's a very dog to the commonalty."),
     user("Consider you what services he has done for his country?"),
     assistant("Very well; and could be content to give him good\n"
               "report fort, but that he pays himself with being proud.")],
    # 4: replies with leading and trailing spaces and newlines in their content.
    [user("Nay, but speak not maliciously."),
     assistant("  I say unto you, what he hath done famously, he did it to that end.  "),
     user("What shouts are these?"),
     assistant("\nThe other side o' the city is risen!\n\n")],
    # 5: system, a non-ASCII reply.
    [sys_("Réponds en français, s'il te plaît."),
     user("Soft! who comes here?"),
     assistant("Café — naïve ✓ Ménénius Agrippa, «l'ami du peuple».")],
    # 6: reasoning in every assistant turn (Qwen3 drops it before the last user message).
    [user("What work's, my countrymen, in hand?"),
     assistant("<think>\nThey ask about our business.\nAnswer plainly.\n</think>\n\n"
               "Our business is not unknown to the senate."),
     user("Will you undo yourselves?"),
     assistant("<think>\nHe fears we ruin ourselves.\n</think>\n\n"
               "We cannot, sir, we are undone already.")],
    # 7: system, three turns; reasoning only in the middle turn, none in the last (Qwen3
    # then writes an empty think block for the last).
    [sys_("Think before you answer."),
     user("Where go you with bats and clubs?"),
     assistant("To the Capitol!"),
     user("The matter? speak, I pray you."),
     assistant("<think>\nThe senate has had inkling this fortnight.\n</think>\n\n"
               "They shall know we have strong arms too."),
     user("Why, masters, my good friends?"),
     assistant("Come, come.")],
    # 8: no system, one turn whose reply holds reasoning and a newline before it.
    [user("I tell you, friends, most charitable care have the patricians of you."),
     assistant("<think>\nMenenius defends the patricians; doubt him.\n</think>\n\n"
               "Care for us! True, indeed!")],
]


def train_tokenizer(text):
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator([text], trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return bpe


def runs(mask):
    """(start, end) of each run of ones in `mask`."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def marked(tok, ids, mask):
    """The decoded row with each trained run between « and »."""
    parts = []
    for i, (t, m) in enumerate(zip(ids, mask)):
        prev = mask[i - 1] if i else 0
        if m and not prev:
            parts.append("«")
        if not m and prev:
            parts.append("»")
        parts.append(t)
    if mask and mask[-1]:
        parts.append("»")
    # Decode token by token groups so that « » fall between tokens.
    text, buf = [], []
    for p in parts:
        if p in ("«", "»"):
            if buf:
                text.append(tok.decode(buf, skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False))
                buf = []
            text.append(p)
        else:
            buf.append(p)
    if buf:
        text.append(tok.decode(buf, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    return "".join(text)


def dump(path, obj):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(obj)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default=os.path.join(ROOT, "..", "shared", "data",
                                                   "tinyshakespeare.txt"))
    ap.add_argument("--show", type=int, default=3,
                    help="print each style's rendering of this conversation, trained "
                         "spans between « and » (-1: none)")
    args = ap.parse_args()

    from transformers import PreTrainedTokenizerFast
    from transformers.utils.chat_template_utils import render_jinja_template

    with open(args.text, encoding="utf-8") as f:
        text = f.read()[:20000]
    os.makedirs(OUT, exist_ok=True)

    tok_path = os.path.join(OUT, "tokenizer.json")
    train_tokenizer(text).save(tok_path)
    raw = Tokenizer.from_file(tok_path)
    for t in SPECIAL_TOKENS + THINK_TOKENS:
        assert raw.token_to_id(t) is not None, t
        assert raw.encode(f"a{t}b", add_special_tokens=False).tokens[1] == t, t

    dump(os.path.join(OUT, "conversations.jsonl"),
         "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n"
                 for c in CONVERSATIONS))

    problems = []
    for name, template, bos, eos in STYLES:
        tok = PreTrainedTokenizerFast(tokenizer_file=tok_path, bos_token=bos, eos_token=eos)
        tok.chat_template = template
        rows = []
        straddles = []
        for r, messages in enumerate(CONVERSATIONS):
            out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
            rendered = tok.apply_chat_template(messages, tokenize=False)
            assert len(ids) == len(mask)
            assert sum(mask) > 0, (name, r)
            # The rendering tokenizes to the same ids, by transformers and by tokenizers.
            plain = tok(rendered, add_special_tokens=False)["input_ids"]
            if plain != ids:
                problems.append(f"{name} row {r}: tok(text) differs from apply_chat_template")
            if raw.encode(rendered, add_special_tokens=False).ids != ids:
                problems.append(f"{name} row {r}: tokenizers' encode differs")
            # Every assistant turn's answer is in a trained run.
            pieces = [tok.decode(ids[a:b], skip_special_tokens=False,
                                 clean_up_tokenization_spaces=False) for a, b in runs(mask)]
            for m in messages:
                if m["role"] == "assistant":
                    answer = m["content"].split("</think>")[-1].strip()
                    assert any(answer in p for p in pieces), (name, r, answer, pieces)
            # Where the generation blocks' edges fall inside a token.
            texts, spans = render_jinja_template([messages], chat_template=template,
                                                 return_assistant_tokens_mask=True,
                                                 **tok.special_tokens_map)
            assert texts[0] == rendered
            enc = raw.encode(rendered, add_special_tokens=False)
            bounds = {s for s, _ in enc.offsets} | {e for _, e in enc.offsets}
            for s, e in spans[0]:
                for edge, what in ((s, "start"), (e, "end")):
                    if edge not in bounds:
                        i = next(i for i, (a, b) in enumerate(enc.offsets) if a < edge < b)
                        straddles.append(f"row {r} block {what}: token {enc.tokens[i]!r} "
                                         f"({rendered[enc.offsets[i][0]:enc.offsets[i][1]]!r})")
            rows.append({"input_ids": ids, "assistant_masks": mask, "text": rendered})
        if name == "qwen3":
            # Reasoning before the last user message is dropped, the last turn's kept.
            assert "They ask about our business" not in rows[6]["text"]
            assert "He fears we ruin ourselves" in rows[6]["text"]
            assert "The senate has had inkling" not in rows[7]["text"]
            assert "<think>\n\n</think>\n\nCome, come." in rows[7]["text"]
        body = ",\n".join("    " + json.dumps(row, ensure_ascii=False) for row in rows)
        dump(os.path.join(OUT, f"{name}.json"),
             "{\n"
             f'  "style": {json.dumps(name)},\n'
             f'  "bos_token": {json.dumps(bos)},\n'
             f'  "eos_token": {json.dumps(eos)},\n'
             f'  "chat_template": {json.dumps(template, ensure_ascii=False)},\n'
             f'  "rows": [\n{body}\n  ]\n'
             "}\n")
        print(f"== {name}: {len(rows)} rows, {sum(len(r['input_ids']) for r in rows)} tokens, "
              f"{sum(sum(r['assistant_masks']) for r in rows)} trained")
        for s in straddles:
            print(f"   straddle {s}")
        if args.show >= 0:
            row = rows[args.show]
            print(marked(tok, row["input_ids"], row["assistant_masks"]))
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
