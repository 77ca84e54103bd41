"""Chat templates of model families other than ChatML, for byte tokenizers built in tests.

Each is the family's shape (markers, roles, where tools go), written for these tests, not the
vendor's text.
"""

from __future__ import annotations

# A Llama 3.1-style template (the family's shape, not Meta's text): headers per role, tools as
# JSON in the system block when tools_in_user_message is false, a call as a bare JSON object,
# tool results in the ipython role.
LLAMA_STYLE = (
    "{%- if tools_in_user_message is not defined %}{%- set tools_in_user_message = true %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{%- if tools is not none and not tools_in_user_message %}"
    '{{- \'Call a function with JSON: {"name": name, "parameters": arguments}.\\n\' }}'
    "{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}{%- endif %}"
    "{{- system }}{{- '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- set f = m['tool_calls'][0]['function'] %}"
    "{{- '{\"name\": \"' + f['name'] + '\", \"parameters\": ' }}"
    "{{- f['arguments'] | tojson }}{{- '}<|eot_id|>' }}"
    "{%- else %}"
    "{%- set role = 'ipython' if m['role'] in ('tool', 'ipython') else m['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{%- if m['content'] is string %}{{- m['content'] }}"
    "{%- else %}{%- for p in m['content'] %}{{- p['text'] }}{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
SPECIALS: dict[str, int] = {
    "<|start_header_id|>": 300,
    "<|end_header_id|>": 301,
    "<|eot_id|>": 302,
    "<|python_tag|>": 303,
}

# SmolLM2's shape: plain ChatML that concatenates ``message['content']`` as a string (a list of
# parts makes it raise), with a default system prompt where the conversation brings none.
CHATML_STRING = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
