"""Ollama's walks over a parsed Go template: the tool-call tag, the thinking tags, the variables.

The case tables are Ollama's own tests, inputs and expected values verbatim (only re-spelled as
Python literals); the tests after them cover templates in the wild, such as Qwen 2.5's
``{{- else if .ToolCalls }}<tool_call>``.
"""

from __future__ import annotations

import pytest

from sidecar.templates.gotemplate import BranchNode, GoTemplate, ListNode, TextNode
from sidecar.templates.ollama import template_vars
from sidecar.templates.tags import infer_think_tags, tool_call_tag
from sidecar.templates.tools import tool_tag

pytestmark = pytest.mark.pure

# tools/template_test.go, TestParseTag: (name, template, want)
PARSE_TAG_CASES: list[tuple[str, str, str]] = [
    ("empty", "", "{"),
    ("no tag", "{{if .ToolCalls}}{{end}}", "{"),
    ("no tag with range", "{{if .ToolCalls}}{{range .ToolCalls}}{{ . }}{{end}}{{end}}", "{"),
    ("tool call with json format", "{{if .ToolCalls}}```json\n{{end}}", "```json"),
    ("square brackets", "{{if .ToolCalls}}[{{range .ToolCalls}}{{ . }}{{end}}]{{end}}", "["),
    ("square brackets with whitespace", "{{if .ToolCalls}}\n [ {{range .ToolCalls}}{{ . }}{{end}}]{{end}}", "["),
    ("tailing ]", "{{if .ToolCalls}}{{range .ToolCalls}}{{ . }}{{end}}]{{end}}", "{"),
    ("whitespace only", "{{if .ToolCalls}} {{range .ToolCalls}}{{ . }}{{end}}{{end}}", "{"),
    ("whitespace only in range", "{{if .ToolCalls}}{{range .ToolCalls}}\n{{ . }}\n{{end}}{{end}}", "{"),
    (
        "json objects",
        (
            '{{if .ToolCalls}}{{range .ToolCalls}}{"name": "{{ .Function.Name }}", "arguments": '
            '{{ .Function.Arguments }}}{{end}}{{end}}'
        ),
        "{",
    ),
    (
        "json objects with whitespace",
        (
            "{{if .ToolCalls}}{{range .ToolCalls}}\n{\"name\": \"{{ .Function.Name }}\", \"arguments\": "
            "{{ .Function.Arguments }}}{{end}}{{end}}"
        ),
        "{",
    ),
    (
        "json objects with CRLF",
        (
            "{{if .ToolCalls}}{{range .ToolCalls}}\r\n{\"name\": \"{{ .Function.Name }}\", \"arguments\": "
            "{{ .Function.Arguments }}}{{end}}{{end}}"
        ),
        "{",
    ),
    (
        "json objects with whitespace before and after range",
        (
            "{{if .ToolCalls}}\n{{range .ToolCalls}}\n{\"name\": \"{{ .Function.Name }}\", \"arguments\": "
            "{{ .Function.Arguments }}}\r\n{{end}}\r\n{{end}}"
        ),
        "{",
    ),
    (
        "before and after range",
        (
            "{{if .ToolCalls}}<|tool▁calls▁begin|>{{range .ToolCalls}}<|tool▁call▁begin|>functionget_current_weather\n"
            "```json\n{\"location\": \"Tokyo\"}\n```<|tool▁call▁end|>\n{{end}}<|tool▁calls▁end|>{{end}}"
        ),
        "<|tool▁calls▁begin|>",
    ),
    (
        "after range",
        (
            "{{if .ToolCalls}}{{range .ToolCalls}}<tool_call>{\"name\": \""
            "{{ .Function.Name }}\", \"arguments\": {{ .Function.Arguments }}}</tool_call>{{end}}{{end}}"
        ),
        "<tool_call>",
    ),
    (
        "after range with leading whitespace before range",
        (
            "{{if .ToolCalls}}\n{{range .ToolCalls}}<tool_call>{\"name\": \""
            "{{ .Function.Name }}\", \"arguments\": {{ .Function.Arguments }}}</tool_call>{{end}}{{end}}"
        ),
        "<tool_call>",
    ),
    (
        "tool call in range with {",
        (
            '{{if .ToolCalls}}{{range .ToolCalls}}<tool_call>{"name": "{{ .Function.Name }}", "arguments": '
            '{{ .Function.Arguments }}}<tool_call>{{end}}{{end}}'
        ),
        "<tool_call>",
    ),
    (
        "tool call with multiple text nodes",
        "{{if .ToolCalls}}First text{{if .Something}}inner{{end}}Second text{{end}}",
        "First text",
    ),
    ("action tag", "{{if .ToolCalls}}Action: ```json{{end}}", "Action: ```json"),
    ("incomplete functools bracket", "{{if .ToolCalls}}functools[{{end}}", "functools["),
    ("uppercase tool call with incomplete bracket", "{{if .ToolCalls}}[TOOL_CALL] [{{end}}", "[TOOL_CALL] ["),
    ("uppercase tool call with adjacent bracket", "{{if .ToolCalls}}[TOOL_CALL][{{end}}", "[TOOL_CALL]["),
]

# thinking/template_test.go, TestInferThinkingTags: (desc, tmplString, wantOpeningTag, wantClosingTag)
THINK_CASES: list[tuple[str, str, str, str]] = [
    (
        "basic",
        """
			{{ if .Thinking}}
				/think
			{{ end }}
			{{- range $i, $_ := .Messages }}
				{{- $last := eq (len (slice $.Messages $i)) 1 -}}
				{{ if and $last .Thinking }}
					<think>{{ .Thinking }}</think>
				{{ end }}
			{{ end }}
		""",
        "<think>",
        "</think>",
    ),
    (
        "doubly nested range",
        """
			{{ if .Thinking}}
				/think
			{{ end }}
			{{- range $i, $_ := .Messages }}
				{{- range $j, $_ := .NotMessages }}
					{{- $last := eq (len (slice $.Messages $i)) 1 -}}
					{{ if and $last .Thinking }}
						<think>{{ .Thinking }}</think>
					{{ end }}
				{{ end }}
			{{ end }}
		""",
        "",
        "",
    ),
    (
        "whitespace is trimmed",
        """
			{{ if .Thinking}}
				/think
			{{ end }}
			{{- range $i, $_ := .Messages }}
				{{- $last := eq (len (slice $.Messages $i)) 1 -}}
				{{ if and $last .Thinking }}
					Some text before   {{ .Thinking }}    Some text after
				{{ end }}
			{{ end }}
		""",
        "Some text before",
        "Some text after",
    ),
    (
        "qwen3",
        """
{{- if or .System .Tools .Thinking }}<|im_start|>system
{{- if .System }}
{{ .System }}
{{- end }}
{{- if .Tools }}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{{- range .Tools }}
{"type": "function", "function": {{ .Function }}}
{{- end }}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{{- end }}
{{- if .Thinking }}
/think
{{- else }}
/no_think
{{- end }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ if and $last .Thinking }}
<think>{{ .Thinking }}</think>
{{ end }}
{{ if .Content }}{{ .Content }}
{{- else if .ToolCalls }}<tool_call>
{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}
{{ end }}</tool_call>
{{- end }}{{ if not $last }}<|im_end|>
{{ end }}
{{- else if eq .Role "tool" }}<|im_start|>user
<tool_response>
{{ .Content }}
</tool_response><|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}
			""",
        "<think>",
        "</think>",
    ),
]

# template/template_test.go, TestParse: (name, template, vars)
VARS_CASES: list[tuple[str, str, list[str]]] = [
    ("PromptOnly", "{{ .Prompt }}", ["prompt", "response"]),
    ("SystemAndPrompt", "{{ .System }} {{ .Prompt }}", ["prompt", "response", "system"]),
    ("PromptResponseSystem", "{{ .System }} {{ .Prompt }} {{ .Response }}", ["prompt", "response", "system"]),
    (
        "ToolsBlock",
        "{{ with .Tools }}{{ . }}{{ end }} {{ .System }} {{ .Prompt }}",
        ["prompt", "response", "system", "tools"],
    ),
    ("MessagesRange", "{{ range .Messages }}{{ .Role }} {{ .Content }}{{ end }}", ["content", "messages", "role"]),
    (
        "ToolResultConditional",
        (
            "{{ range .Messages }}{{ if eq .Role \"tool\" }}Tool Result: {{ .ToolName }} {{ .Content }}"
            "{{ end }}{{ end }}"
        ),
        ["content", "messages", "role", "toolname"],
    ),
    (
        "MultilineSystemUserAssistant",
        """{{- range .Messages }}
{{- if eq .Role "system" }}SYSTEM:
{{- else if eq .Role "user" }}USER:
{{- else if eq .Role "assistant" }}ASSISTANT:
{{- else if eq .Role "tool" }}TOOL:
{{- end }} {{ .Content }}
{{- end }}""",
        ["content", "messages", "role"],
    ),
    (
        "ChatMLLike",
        """{{- if .Messages }}
{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ else -}}
{{ if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ .Response }}<|im_end|>
{{- end -}}""",
        ["content", "messages", "prompt", "response", "role", "system"],
    ),
]


@pytest.mark.parametrize(("name", "template", "want"), PARSE_TAG_CASES, ids=[c[0] for c in PARSE_TAG_CASES])
def test_parse_tag(name: str, template: str, want: str) -> None:
    """tools/template_test.go TestParseTag."""
    assert tool_call_tag(GoTemplate(template, name=name)) == want


@pytest.mark.parametrize(("desc", "template", "opening", "closing"), THINK_CASES, ids=[c[0] for c in THINK_CASES])
def test_infer_thinking_tags(desc: str, template: str, opening: str, closing: str) -> None:
    """thinking/template_test.go TestInferThinkingTags."""
    assert infer_think_tags(GoTemplate(template, name=desc)) == (opening, closing)


@pytest.mark.parametrize(("name", "template", "want"), VARS_CASES, ids=[c[0] for c in VARS_CASES])
def test_vars(name: str, template: str, want: list[str]) -> None:
    """template/template_test.go TestParse: Vars() after Parse, which appends {{ .Response }} to legacy templates."""
    assert sorted(template_vars(GoTemplate(template, name=name))) == want


# A template shaped like the qwen2.5 one in Ollama's library: the tool calls follow `{{- else if .ToolCalls }}`.
QWEN25 = """{{- if .Messages }}
{{- if or .System .Tools }}<|im_start|>system
{{- if .System }}
{{ .System }}
{{- end }}
{{- if .Tools }}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{{- range .Tools }}
{"type": "function", "function": {{ .Function }}}
{{- end }}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
{{- end }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ if .Content }}{{ .Content }}
{{- else if .ToolCalls }}<tool_call>
{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}
{{ end }}</tool_call>
{{- end }}{{ if not $last }}<|im_end|>
{{ end }}
{{- else if eq .Role "tool" }}<|im_start|>user
<tool_response>
{{ .Content }}
</tool_response><|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}
{{- else }}
{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ end }}{{ .Response }}{{ if .Response }}<|im_end|>{{ end }}"""

# The Mistral example of Ollama's docs/template.mdx: the calls follow `{{- else if .ToolCalls }}[TOOL_CALLS] [`.
MISTRAL_DOCS = """{{- range $index, $_ := .Messages }}
{{- if eq .Role "user" }}
{{- if and (le (len (slice $.Messages $index)) 2) $.Tools }}[AVAILABLE_TOOLS] {{ json $.Tools }}[/AVAILABLE_TOOLS]
{{- end }}[INST] {{ if and (eq (len (slice $.Messages $index)) 1) $.System }}{{ $.System }}

{{ end }}{{ .Content }}[/INST]
{{- else if eq .Role "assistant" }}
{{- if .Content }} {{ .Content }}</s>
{{- else if .ToolCalls }}[TOOL_CALLS] [
{{- range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ json .Function.Arguments }}}
{{- end }}]</s>
{{- end }}
{{- else if eq .Role "tool" }}[TOOL_RESULTS] {"content": {{ .Content }}}[/TOOL_RESULTS]
{{- end }}
{{- end }}"""


def test_else_if_is_an_else_list_holding_the_if() -> None:
    """Go parses `{{if a}}x{{else if b}}y{{end}}` as `{{if a}}x{{else}}{{if b}}y{{end}}{{end}}`."""
    outer = GoTemplate("{{ if .A }}x{{ else if .ToolCalls }}y{{ end }}").root.nodes[0]
    assert isinstance(outer, BranchNode) and outer.kind == "if"
    assert isinstance(outer.else_body, ListNode) and len(outer.else_body.nodes) == 1
    inner = outer.else_body.nodes[0]
    assert isinstance(inner, BranchNode) and inner.kind == "if" and inner.else_body is None
    assert [type(n) for n in inner.body.nodes] == [TextNode]


def test_tool_call_tag_after_else_if() -> None:
    """Qwen 2.5 and Qwen 3 open their calls in an `else if .ToolCalls` branch."""
    assert tool_call_tag(GoTemplate(QWEN25)) == "<tool_call>"
    assert tool_call_tag(GoTemplate(THINK_CASES[-1][1])) == "<tool_call>"  # Ollama's qwen3 test template
    assert tool_tag(QWEN25) == "<tool_call>"


def test_tool_tag_drops_the_bracket_that_opens_the_calls() -> None:
    """Ollama's tag keeps the "[" (and its parser scans for "[TOOL_CALLS] ["); ours stops before the JSON array."""
    assert tool_call_tag(GoTemplate(MISTRAL_DOCS)) == "[TOOL_CALLS] ["
    assert tool_tag(MISTRAL_DOCS) == "[TOOL_CALLS]"


def test_only_an_if_on_a_tool_calls_field_counts() -> None:
    """findToolCallNode looks at `if` conditions only, and at field nodes only."""
    assert tool_call_tag(GoTemplate("{{ range .ToolCalls }}<tool_call>{{ . }}{{ end }}")) == "{"
    assert tool_call_tag(GoTemplate("{{ with .ToolCalls }}<tool_call>{{ . }}{{ end }}")) == "{"
    assert tool_call_tag(GoTemplate("{{ range $m := .Messages }}{{ if $m.ToolCalls }}<a>{{ end }}{{ end }}")) == "{"
    assert tool_call_tag(GoTemplate("{{ with .Last }}{{ if .Message.ToolCalls }}<a>{{ end }}{{ end }}")) == "<a>"


def test_capabilities_from_vars() -> None:
    """server/images.go: `tools` when Vars has "tools", `insert` when it has "suffix"."""
    assert "tools" in template_vars(GoTemplate(QWEN25))
    assert "suffix" not in template_vars(GoTemplate(QWEN25))
    assert "suffix" in template_vars(GoTemplate("<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>"))
    assert infer_think_tags(GoTemplate(QWEN25)) == ("", "")
