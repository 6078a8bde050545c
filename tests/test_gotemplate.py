"""Tests for the Go text/template renderer and its Ollama layer.

Expected strings in the engine tables were checked against Go's own text/template; the Ollama
expectations follow Ollama's template/template.go (Execute, collate, deleteNode).
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.templates.gotemplate import GoTemplate, TemplateError
from sidecar.templates.named import levenshtein, named, named_templates
from sidecar.templates.ollama import render_ollama

pytestmark = pytest.mark.pure

# ---------------------------------------------------------------------------------------------
# Conformance: Ollama's own template test data (tests/data/ollama-templates, a copy of
# shared/conformance/ollama-templates kept in the repo so a lone clone runs the whole suite)
# ---------------------------------------------------------------------------------------------

CONFORMANCE_DIR = Path(__file__).resolve().parent / "data" / "ollama-templates"

_USER = {"role": "user", "content": "Hello, how are you?"}
_ASSISTANT = {"role": "assistant", "content": "I'm doing great. How can I help you today?"}
_USER_2 = {"role": "user", "content": "I'd like to show off how chat templating works!"}
_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}

# The three conversations described in the conformance README.
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [_USER],
    "user-assistant-user": [_USER, _ASSISTANT, _USER_2],
    "system-user-assistant-user": [_SYSTEM, _USER, _ASSISTANT, _USER_2],
}

# Ollama's TestTemplate drops one trailing space from the output of exactly these templates.
TRAILING_SPACE_TEMPLATES = frozenset(
    {"chatqa.gotmpl", "llama2-chat.gotmpl", "mistral-instruct.gotmpl", "openchat.gotmpl", "vicuna.gotmpl"}
)


def _template_paths() -> list[Path]:
    return sorted(CONFORMANCE_DIR.glob("*.gotmpl")) if CONFORMANCE_DIR.is_dir() else []


def _conformance_params() -> list[Any]:
    params = [
        pytest.param(path, case, id=f"{path.stem}/{case}")
        for path in _template_paths()
        for case in CONVERSATIONS
    ]
    # Missing data must fail, not silently shrink to zero tests.
    return params or [pytest.param(None, None, id="conformance-data-missing")]


def test_conformance_data_present() -> None:
    assert CONFORMANCE_DIR.is_dir(), f"conformance data not found at {CONFORMANCE_DIR}"
    assert len(_template_paths()) >= 10


@pytest.mark.parametrize(("template_path", "case"), _conformance_params())
def test_ollama_conformance(template_path: Path | None, case: str | None) -> None:
    if template_path is None or case is None:
        pytest.fail(f"no *.gotmpl conformance templates found in {CONFORMANCE_DIR}")
    expected = (CONFORMANCE_DIR / "testdata" / template_path.name / case).read_bytes()
    template = GoTemplate(template_path.read_bytes().decode("utf-8"), name=template_path.name)

    rendered = render_ollama(template, CONVERSATIONS[case]).encode("utf-8")
    if template_path.name in TRAILING_SPACE_TEMPLATES and rendered.endswith(b" "):
        rendered = rendered[:-1]

    assert rendered == expected


def test_conformance_has_no_unknown_cases() -> None:
    for path in _template_paths():
        cases = {p.name for p in (CONFORMANCE_DIR / "testdata" / path.name).iterdir()}
        assert cases == set(CONVERSATIONS), path.name


# ---------------------------------------------------------------------------------------------
# Engine: table-driven cases (template, data, expected output)
# ---------------------------------------------------------------------------------------------

DATA: dict[str, Any] = {
    "A": 1,
    "B": 2.5,
    "S": "héllo",
    "E": "",
    "T": True,
    "F": False,
    "Z": 0,
    "N": None,
    "L": [1, 2, 3],
    "LS": ["a", "b"],
    "EL": [],
    "M": {"b": 2, "a": 1, "c": {"d": "deep"}},
    "EM": {},
    "Messages": [
        {"Role": "system", "Content": "sys"},
        {"Role": "user", "Content": "hi"},
        {"Role": "assistant", "Content": "yo"},
    ],
}


def render(source: str, data: Mapping[str, Any] | None = None) -> str:
    return GoTemplate(source).execute(DATA if data is None else data)


TRIM_CASES = [
    ("both sides", "a  {{- .A -}}  b", "a1b"),
    ("all whitespace kinds", "a \t\r\n{{- .A -}}\n\r\t b", "a1b"),
    ("left only", "a  {{- .A }}  b", "a1  b"),
    ("right only", "a  {{ .A -}}  b", "a  1b"),
    ("trims across lines", "x\n\n  {{- .A }}\n  {{- .A -}}\n\ny", "x11y"),
    ("negative number, not a marker", "{{-3}}", "-3"),
    ("marker needs a space", "{{ -3 }}", "-3"),
    ("comment", "x {{/* note */}} y", "x  y"),
    ("trimmed comment", "x {{- /* note */ -}} y", "xy"),
    ("multi-line comment", "{{ 1 }}{{- /* a\nb */ -}}\n\n{{ 2 }}", "12"),
    ("newlines inside action", "{{\n.A\n}}", "1"),
    ("delimiters in strings", 'x{{ "}}" }}y{{ "{{" }}', "x}}y{{"),
    ("stray closing braces are text", "a}}b", "a}}b"),
]

CONTROL_CASES = [
    ("if true", "{{ if .A }}yes{{ else }}no{{ end }}", "yes"),
    ("else if chain", "{{ if .Z }}z{{ else if .E }}e{{ else if .L }}l{{ else }}none{{ end }}", "l"),
    (
        "falsy values",
        "{{ if .EL }}1{{ else if .EM }}2{{ else if .N }}3{{ else if .F }}4{{ else }}5{{ end }}",
        "5",
    ),
    ("missing key is falsy", "{{ if .Nope }}a{{ else }}b{{ end }}", "b"),
    (
        "range with index",
        "{{ range $i, $m := .Messages }}{{ $i }}:{{ $m.Role }}={{ .Content }};{{ end }}",
        "0:system=sys;1:user=hi;2:assistant=yo;",
    ),
    ("range single var is element", "{{ range $m := .LS }}[{{ $m }}]{{ end }}", "[a][b]"),
    ("range else", "{{ range .EL }}x{{ else }}empty{{ end }}", "empty"),
    ("range nil", "{{ range .N }}x{{ else }}nil{{ end }}", "nil"),
    ("range map sorted", "{{ range $k, $v := .M }}{{ $k }}={{ $v }},{{ end }}", "a=1,b=2,c=map[d:deep],"),
    ("range int", "{{ range 3 }}{{ . }}{{ end }}", "012"),
    ("continue", "{{ range .L }}{{ if eq . 2 }}{{ continue }}{{ end }}{{ . }}{{ end }}", "13"),
    ("break", "{{ range .L }}{{ if eq . 2 }}{{ break }}{{ end }}{{ . }}{{ end }}", "1"),
    ("break skips else", "{{ range .L }}{{ break }}{{ else }}e{{ end }}", ""),
    ("nested range with $", "{{ range .L }}{{ range $.LS }}{{ . }}{{ end }}{{ . }}{{ end }}", "ab1ab2ab3"),
    ("with sets dot", "{{ with .M }}{{ .a }}{{ $.A }}{{ end }}", "11"),
    ("with else", "{{ with .E }}x{{ else }}none{{ end }}", "none"),
    ("else with", "{{ with .Nope }}x{{ else with .S }}{{ . }}{{ end }}", "héllo"),
    ("with declaration", "{{ with $x := .A }}{{ $x }}{{ . }}{{ end }}", "11"),
    ("empty blocks", "{{ if .A }}{{ else }}{{ end }}{{ range .L }}{{ end }}{{ with .A }}{{ end }}", ""),
]

FUNCTION_CASES = [
    ("eq any of", '{{ eq .A 1 }} {{ eq .A 2 3 1 }} {{ eq .S "x" }} {{ eq .N .E }}', "true true false false"),
    ("ne", '{{ ne .A 2 }} {{ ne .S "héllo" }}', "true false"),
    ("eq nil nil", "{{ eq nil nil }} {{ eq .N .Nope }}", "true true"),
    ("ordering", '{{ lt 1 2 }} {{ le 2 2 }} {{ gt "b" "a" }} {{ ge 1.5 2.5 }}', "true true true false"),
    ("and returns operand", "{{ and 1 0 2 }} {{ and 1 2 }}", "0 2"),
    ("or returns operand", '{{ or 0 "" .LS }} {{ or 0 "" }}', "[a b] "),
    ("and/or short-circuit", "{{ or .A (index .L 99) }} {{ and .Z (index .L 99) }}", "1 0"),
    ("and in pipeline", "{{ .A | and 1 }} {{ .Z | or 0 }}", "1 0"),
    ("not", "{{ not .A }} {{ not .E }} {{ not .EL }} {{ not nil }}", "false true true true"),
    ("len", "{{ len .S }} {{ len .L }} {{ len .M }} {{ len .E }}", "6 3 3 0"),
    ("index", '{{ index .L 1 }} {{ index .M "b" }} {{ index .M "c" "d" }} {{ index .S 1 }}', "2 2 deep 195"),
    ("index missing map key", '{{ index .M "zz" }}|', "|"),
    ("slice", "{{ slice .L 1 }} {{ slice .L 1 2 }} {{ slice .LS 0 0 }} {{ slice .L 3 }}", "[2 3] [2] [] []"),
    ("slice string bytes", "{{ slice .S 0 1 }}|{{ slice .S 0 3 }}", "h|hé"),
    (
        "json",
        "{{ json .M }} {{ json .L }} {{ json .EL }} {{ json .T }} {{ json nil }}",
        '{"b":2,"a":1,"c":{"d":"deep"}} [1,2,3] [] true null',
    ),
    (
        "json html escaping",
        '{{ json "<a href=\\"x\\">&</a>" }}',
        '"\\u003ca href=\\"x\\"\\u003e\\u0026\\u003c/a\\u003e"',
    ),
    (
        "json control chars",
        '{{ json "a\\tb\\nc\\u0001\\u2028\\b\\f\\\\" }}',
        '"a\\tb\\nc\\u0001\\u2028\\b\\f\\\\"',
    ),
    (
        "json floats",
        "{{ json 1e21 }} {{ json 1e20 }} {{ json 0.000001 }} {{ json 1e-7 }} {{ json 3.0 }} {{ json -0.5 }}",
        "1e+21 100000000000000000000 0.000001 1e-7 3 -0.5",
    ),
    ("json unicode kept", '{{ json "é→😀" }}', '"é→😀"'),
    ("print", '{{ print 1 2 "a" "b" 3 nil }}', "1 2ab3 <nil>"),
    ("println", '{{ println 1 "a" }}', "1 a\n"),
    ("printf basic verbs", '{{ printf "%s-%d-%v-%q-%t" .S .A .L .S .T }}', 'héllo-1-[1 2 3]-"héllo"-true'),
    (
        "printf width and precision",
        '{{ printf "%5d|%-5s|%05d|%.2f|%x|%c" 42 "ab" -42 3.14159 255 65 }}',
        "   42|ab   |-0042|3.14|ff|A",
    ),
    (
        "printf mistakes",
        '{{ printf "%d" "x" }} {{ printf "%d %d" 1 }} {{ printf "%d" 1 2 }} {{ printf "100%%" }}',
        "%!d(string=x) 1 %!d(MISSING) 1%!(EXTRA int=2) 100%",
    ),
    ("printf multi-turn system", '{{ printf "%s\\n\\n%s" "a" "b" }}', "a\n\nb"),
    ("html", '{{ html "<a b=\\"c\\">&\'" }}', "&lt;a b=&#34;c&#34;&gt;&amp;&#39;"),
    ("urlquery", '{{ urlquery "a b&c=d/é" }}', "a+b%26c%3Dd%2F%C3%A9"),
]

VALUE_CASES = [
    ("scalars", "{{ .A }} {{ .B }} {{ .S }} {{ .T }} {{ .F }} {{ .Z }}", "1 2.5 héllo true false 0"),
    (
        "composites",
        "{{ .L }} {{ .LS }} {{ .EL }} {{ .M }} {{ .EM }}",
        "[1 2 3] [a b] [] map[a:1 b:2 c:map[d:deep]] map[]",
    ),
    (
        "floats like Go",
        "{{ 1e6 }} {{ 123456.0 }} {{ 0.0001 }} {{ 0.00001 }} {{ 3.0 }} {{ -2.5e-3 }}",
        "1e+06 123456 0.0001 1e-05 3 -0.0025",
    ),
    ("nil and missing print empty", "[{{ .N }}][{{ .Nope }}][{{ .Nope.Deeper }}]", "[][][]"),
    ("string escapes", '{{ "a\\tb\\x41\\u00e9\\101\\\\" }}', "a\tbAéA\\"),
    ("raw string", "{{ `raw\\n{{x}}` }}", "raw\\n{{x}}"),
    (
        "char and int literals",
        "{{ 'a' }} {{ '\\n' }} {{ 0x1F }} {{ 0o17 }} {{ 017 }} {{ 1_000 }}",
        "97 10 31 15 15 1000",
    ),
    ("float literals", "{{ .5 }} {{ 1e3 }}", "0.5 1000"),
    ("bool literals", "{{ true }} {{ false }}", "true false"),
    ("field chains", "{{ .M.a }}{{ .M.c.d }}{{ $.M.a }}{{ (index .Messages 1).Role }}", "1deep1user"),
    (
        "parenthesised pipelines",
        "{{ (print 1 2) }} {{ (len .L) | print }} {{ print (len .L) (index .L 0) }} {{ ((1)) }}",
        "1 2 3 3 1 1",
    ),
    (
        "pipelines",
        '{{ .S | printf "%s!" }} {{ .L | len | print "n=" }} {{ .S | len | eq 0 | not }}',
        "héllo! n=3 true",
    ),
]

VARIABLE_CASES = [
    ("declare and assign", "{{ $x := 1 }}{{ $x }}{{ $x = 2 }}{{ $x }}", "12"),
    ("assignment in range persists", "{{ $x := .S }}{{ range .L }}{{ $x = . }}{{ end }}{{ $x }}", "3"),
    ("declaration in body is per iteration", "{{ range .L }}{{ $y := . }}{{ $y }}{{ end }}", "123"),
    ("shadowing in block", "{{ $x := 1 }}{{ if true }}{{ $x := 2 }}{{ $x }}{{ end }}{{ $x }}", "21"),
    ("range variable shadows", "{{ $x := 5 }}{{ range $x := .LS }}{{ $x }}{{ end }}{{ $x }}", "ab5"),
    ("root variable", "{{ $.A }}{{ range .L }}{{ $.A }}{{ end }}", "1111"),
    ("variable field chain", "{{ $m := .M }}{{ $m.a }}{{ $m.c.d }}", "1deep"),
    ("pipeline into variable", '{{ $y := len .L | print "n" }}{{ $y }}', "n3"),
    ("declaration prints nothing", "{{ $x := 42 }}", ""),
]


def _ids(cases: list[tuple[str, str, str]]) -> list[str]:
    return [c[0] for c in cases]


@pytest.mark.parametrize(("name", "source", "expected"), TRIM_CASES, ids=_ids(TRIM_CASES))
def test_trim_markers_and_comments(name: str, source: str, expected: str) -> None:
    assert render(source) == expected


@pytest.mark.parametrize(("name", "source", "expected"), CONTROL_CASES, ids=_ids(CONTROL_CASES))
def test_control_flow(name: str, source: str, expected: str) -> None:
    assert render(source) == expected


@pytest.mark.parametrize(("name", "source", "expected"), FUNCTION_CASES, ids=_ids(FUNCTION_CASES))
def test_functions(name: str, source: str, expected: str) -> None:
    assert render(source) == expected


@pytest.mark.parametrize(("name", "source", "expected"), VALUE_CASES, ids=_ids(VALUE_CASES))
def test_values_and_literals(name: str, source: str, expected: str) -> None:
    assert render(source) == expected


@pytest.mark.parametrize(("name", "source", "expected"), VARIABLE_CASES, ids=_ids(VARIABLE_CASES))
def test_variables(name: str, source: str, expected: str) -> None:
    assert render(source) == expected


def test_json_preserves_dict_key_order() -> None:
    data = {"Tools": [{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": 2}}}]}
    assert (
        render("{{ json .Tools }}", data)
        == '[{"type":"function","function":{"name":"f","parameters":{"z":1,"a":2}}}]'
    )


def test_current_date() -> None:
    assert render("{{ currentDate }}") == datetime.date.today().strftime("%Y-%m-%d")


def test_parse_once_execute_many() -> None:
    template = GoTemplate("{{ range .Messages }}{{ .Role }}:{{ .Content }} {{ end }}")
    assert template.execute({"Messages": [{"Role": "user", "Content": "a"}]}) == "user:a "
    assert template.execute({"Messages": []}) == ""
    assert template.execute({}) == ""


def test_tuples_and_nested_mappings() -> None:
    data = {"Messages": ({"Role": "user", "ToolCalls": [{"Function": {"Name": "f"}}]},)}
    assert (
        render("{{ range .Messages }}{{ range .ToolCalls }}{{ .Function.Name }}{{ end }}{{ end }}", data)
        == "f"
    )


def test_invalid_utf8_from_byte_slicing_is_repaired() -> None:
    # Go slices strings by byte; split characters rejoin when printed next to each other.
    assert render("{{ slice .S 0 2 }}{{ slice .S 2 }}") == "héllo"
    assert render("{{ slice .S 0 2 }}") == "h\ufffd"


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

PARSE_ERRORS = [
    ("{{ .A", "unclosed action"),
    ("{{ if .A }}x", "unexpected EOF"),
    ("{{ end }}", "unexpected {{end}}"),
    ("{{ else }}", "unexpected {{else}}"),
    ("{{ if }}{{ end }}", "missing value for if"),
    ("{{ $nope }}", 'undefined variable "$nope"'),
    ("{{ if true }}{{ $z := 1 }}{{ end }}{{ $z }}", 'undefined variable "$z"'),
    ("{{ nofunc 1 }}", 'function "nofunc" not defined'),
    ("{{ break }}", "{{break}} outside {{range}}"),
    ("{{ (1 }}", "unclosed left paren"),
    ("{{ 1) }}", "unexpected right paren"),
    ('{{ "abc }}', "unterminated quoted string"),
    ("{{/* unclosed }}", "unclosed comment"),
    ("{{/* c */ x}}", "comment ends before closing delimiter"),
    ("{{ /* c */ }}", 'unexpected "/" in command'),
    ("{{ 1 | 2 }}", "non executable command in pipeline stage 2"),
    ("{{ $x, $y := .L }}", "too many declarations in command"),
    ("{{ 08 }}", 'illegal number syntax: "08"'),
    ("{{ .A.1 }}", 'unexpected ".1" in operand'),
    ("{{ 1x }}", 'bad number syntax: "1x"'),
    ("{{ range .L }}{{ else }}{{ else }}{{ end }}", "expected end; found {{else}}"),
    ('{{ define "x" }}{{ end }}', "not supported"),
]


@pytest.mark.parametrize(("source", "message"), PARSE_ERRORS, ids=[m for _, m in PARSE_ERRORS])
def test_parse_errors(source: str, message: str) -> None:
    with pytest.raises(TemplateError) as info:
        GoTemplate(source)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_parse_error_names_line_and_column() -> None:
    source = "line one\n{{ if .A }}\n  {{ .B | nofunc }}\n{{ end }}"
    with pytest.raises(TemplateError) as info:
        GoTemplate(source, name="chat")
    err = info.value
    assert (err.line, err.column) == (3, 11)
    assert str(err) == 'template: chat: line 3, column 11: function "nofunc" not defined'


def test_nesting_past_pythons_stack_is_a_template_error() -> None:
    """Go nests parentheses up to 10,000 (parse.go, maxStackDepth) and controls without a cap; here
    each level costs Python frames, so a deep template fails as Go's over-deep one does (a
    TemplateError, the request's 500), not as a RecursionError."""
    for source in ("{{ " + "(" * 2000 + ".A" + ")" * 2000 + " }}", "{{ if 1 }}" * 2000 + "{{ end }}" * 2000):
        with pytest.raises(TemplateError, match=r"^template: max expression depth exceeded$"):
            GoTemplate(source)
    nested = GoTemplate("{{ " + "(" * 50 + ".A" + ")" * 50 + " }}")
    assert nested.execute({"A": "x"}) == "x"
    depth, frame = 0, sys._getframe()
    while frame := frame.f_back:  # type: ignore[assignment]
        depth += 1
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + 40)  # the template runs on a stack that is nearly full
    try:
        with pytest.raises(TemplateError, match=r"^template: exceeded maximum template depth$"):
            nested.execute({"A": "x"})  # 50 levels of parentheses need more than 40 frames
    finally:
        sys.setrecursionlimit(limit)


def test_unexpected_eof_points_at_end() -> None:
    with pytest.raises(TemplateError) as info:
        GoTemplate("{{ range .L }}\nbody\n")
    assert info.value.line == 3
    assert "unexpected EOF" in str(info.value)


GO_WORDS = [  # what Ollama answers (err.Error() of Go's text/template), ParseName ""
    ("{{ .Prompt ", "template: :1: unclosed action"),
    ("a\n{{ if }}", "template: :2: missing value for if"),
    ("{{ .A\n", "template: :2: unclosed action started at :1"),  # Tree.unexpected: where it began
    ("{{ .A\n 'x }}", "template: :2: unterminated character constant in action started at :1"),
    ("{{ index .L 3 }}", 'template: :1:3: executing "" at <index .L 3>: error calling index: index out of range: 3'),
    ("x\n  {{ not }}", 'template: :2:5: executing "" at <not>: wrong number of args for not: want 1 got 0'),
    ("{{ .S.Nope }}", 'template: :1:5: executing "" at <.S.Nope>: can\'t evaluate field Nope in type interface {}'),
    ("é{{ .M.c.d.e.f.g.h.i.j.k }}", 'template: :1:7: executing "" at <.M.c.d.e.f.g.h.i.j.k>: '
                                    "can't evaluate field e in type interface {}"),
]


@pytest.mark.parametrize(("source", "go"), GO_WORDS, ids=[go for _, go in GO_WORDS])
def test_errors_in_gos_words(source: str, go: str) -> None:
    """TemplateError.go is Go's own text: the line for a parse error (parse.go, Tree.errorf), and
    where a multi-line action began (Tree.unexpected); the line, the byte in it and the whole node
    for an execution error (exec.go, state.errorf; ErrorContext). A chain is placed at its first
    added field (operand's newChain)."""
    with pytest.raises(TemplateError) as info:
        GoTemplate(source).execute(DATA)
    assert info.value.go == go


EXEC_ERRORS = [
    ("{{ index .L 3 }}", "error calling index: index out of range: 3"),
    ("{{ index .A 1 }}", "can't index item of type int"),
    ("{{ slice .L 2 1 }}", "invalid slice index: 2 > 1"),
    ("{{ len .A }}", "len of type int"),
    ("{{ eq .A 1.0 }}", "incompatible types for comparison"),
    ('{{ eq .A "1" }}', "incompatible types for comparison"),
    ("{{ lt true false }}", "invalid type for comparison"),
    ("{{ eq .L .L }}", "non-comparable type"),
    ("{{ eq .A }}", "missing argument for comparison"),
    ("{{ .A.Foo }}", "can't evaluate field Foo in type interface {}"),  # looked up in a map[string]any
    ("{{ $a := .A }}{{ $a.Foo }}", "can't evaluate field Foo in type int"),  # a variable holds the value
    ('{{ "x" | .A }}', "A is not a method but has arguments"),
    ("{{ .A 1 }}", "A is not a method but has arguments"),
    ("{{ $x := 1 }}{{ $x 1 }}", "can't give argument to non-function $x"),
    ("{{ range .S }}x{{ end }}", "range can't iterate over héllo"),
    ("{{ nil }}", "nil is not a command"),
    ("{{ json 1 2 }}", "wrong number of args for json: want 1 got 2"),
    ("{{ not }}", "wrong number of args for not: want 1 got 0"),
    ("{{ printf 1 }}", "wrong type for value; expected string; got int"),
    ("{{ 9223372036854775808 }}", "9223372036854775808 overflows int"),
]


@pytest.mark.parametrize(("source", "message"), EXEC_ERRORS, ids=[m for _, m in EXEC_ERRORS])
def test_execution_errors(source: str, message: str) -> None:
    template = GoTemplate(source)  # parses fine: these are run-time errors in Go too
    with pytest.raises(TemplateError) as info:
        template.execute(DATA)
    assert message in str(info.value)
    assert info.value.line == 1


# ---------------------------------------------------------------------------------------------
# Ollama semantics
# ---------------------------------------------------------------------------------------------

CHATML = "{{ range .Messages }}<|{{ .Role }}|>{{ .Content }}\n{{ end }}<|assistant|>"
LEGACY_LLAMA2 = "[INST] {{ if .System }}<<SYS>>{{ .System }}<</SYS>>\n\n{{ end }}{{ .Prompt }} [/INST]"

TOOL_TEMPLATE = (
    "{{ if .Tools }}[TOOLS]{{ json .Tools }}[/TOOLS]{{ end }}"
    "{{ range .Messages }}{{ if .ToolCalls }}[CALLS]{{ range .ToolCalls }}"
    '{"name":"{{ .Function.Name }}","arguments":{{ .Function.Arguments }}}{{ end }}'
    '{{ else if eq .Role "tool" }}[RESULT {{ .ToolName }}]{{ .Content }}'
    "{{ else }}[{{ .Role }}]{{ .Content }}{{ end }}{{ end }}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now>",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"type": ["string", "null"], "enum": ["c", "f"]},
                "city": {"type": "string"},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_messages_path_collates_consecutive_roles_and_system() -> None:
    template = GoTemplate("[{{ .System }}]" + CHATML)
    messages = [
        {"role": "system", "content": "s1"},
        {"role": "system", "content": "s2"},
        {"role": "user", "content": "a"},
        {"role": "USER", "content": "b"},
        {"role": "assistant", "content": "c"},
        {"role": "system", "content": "s3"},
    ]
    assert render_ollama(template, messages) == (
        "[s1\n\ns2\n\ns3]<|system|>s1\n\ns2\n<|user|>a\n\nb\n<|assistant|>c\n<|system|>s3\n<|assistant|>"
    )


def test_messages_path_keeps_tool_messages_separate() -> None:
    template = GoTemplate(CHATML)
    messages = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert render_ollama(template, messages) == "<|tool|>1\n<|tool|>2\n<|assistant|>"


def test_system_and_prompt_keywords() -> None:
    template = GoTemplate(CHATML)
    assert render_ollama(template, system="sys", prompt="hi") == "<|system|>sys\n<|user|>hi\n<|assistant|>"
    # A conversation that already starts with a system message keeps it.
    messages = [{"role": "system", "content": "mine"}]
    assert render_ollama(template, messages, system="default") == "<|system|>mine\n<|assistant|>"


def test_legacy_template_renders_each_turn_and_cuts_the_last_at_response() -> None:
    # No .Messages and no .Response: Ollama appends {{ .Response }} and renders per turn.
    template = GoTemplate(LEGACY_LLAMA2)
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]
    assert render_ollama(template, messages) == "[INST] <<SYS>>S<</SYS>>\n\nQ1 [/INST]A1[INST] Q2 [/INST]"


def test_legacy_cut_drops_everything_after_response() -> None:
    template = GoTemplate("<s>{{ .Prompt }}|{{ .Response }}</s>{{ if .System }}!{{ end }}\n")
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "partial"},
    ]
    assert render_ollama(template, messages) == "<s>q1|a1</s>\n<s>q2|partial"


def test_legacy_turn_boundaries() -> None:
    template = GoTemplate("({{ .System }}|{{ .Prompt }}|{{ .Response }})")
    messages = [
        {"role": "user", "content": "u1"},
        {"role": "system", "content": "s1"},  # flushes the pending prompt
        {"role": "assistant", "content": "a1"},
        {"role": "tool", "content": "ignored"},
        {"role": "user", "content": "u2"},  # flushes after a response
    ]
    assert render_ollama(template, messages) == "(|u1|)(s1||a1)(|u2|"


def test_legacy_pipeline_after_response_is_removed() -> None:
    # deleteNode drops a command whose arguments are all cut, and with it the whole action.
    template = GoTemplate('{{ .Prompt }}:{{ .Response | printf "%s" }}<end>')
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert render_ollama(template, messages) == "q:"


def test_legacy_cut_inside_branch_with_else_fails_like_ollama() -> None:
    # Go panics in deleteNode for this shape; Ollama answers with an error.
    template = GoTemplate("{{ .Prompt }}{{ if .System }}{{ .Response }}{{ else }}x{{ end }}")
    with pytest.raises(TemplateError):
        render_ollama(template, [{"role": "user", "content": "q"}])


def test_legacy_templates_have_no_tools() -> None:
    # Without .Messages anywhere, Ollama takes the legacy path, which passes no .Tools.
    template = GoTemplate("{{ .Tools | len }}")
    with pytest.raises(TemplateError, match="len of nil pointer"):
        render_ollama(template, [{"role": "user", "content": "q"}], tools=[WEATHER_TOOL])


def test_legacy_final_turn_has_only_builtin_functions() -> None:
    template = GoTemplate("{{ json .Prompt }}{{ .Response }}")
    with pytest.raises(TemplateError, match='"json" is not a defined function'):
        render_ollama(template, [{"role": "user", "content": "q"}])


def test_template_naming_response_gets_nothing_appended() -> None:
    template = GoTemplate("{{ .Prompt }}{{ if .Response }}={{ .Response }}{{ end }}")
    assert render_ollama(template, [{"role": "user", "content": "q"}]) == "q"


def test_missing_keys_print_no_value_in_ollama_data() -> None:
    # Ollama executes with map[string]any: keys it does not pass print "<no value>".
    template = GoTemplate("{{ range .Messages }}{{ .Content }}{{ end }}|{{ .Prompt }}|{{ .Suffix }}")
    assert render_ollama(template, [{"role": "user", "content": "q"}]) == "q|<no value>|<no value>"


def test_message_fields_are_struct_fields() -> None:
    template = GoTemplate("{{ range .Messages }}{{ .Nope }}{{ end }}")
    with pytest.raises(TemplateError, match="can't evaluate field Nope"):
        render_ollama(template, [{"role": "user", "content": "q"}])


def test_tools_and_tool_calls() -> None:
    template = GoTemplate(TOOL_TEMPLATE)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"unit": "c", "city": "Paris", "n": 2}}}
            ],
        },
        {"role": "tool", "content": "21", "tool_name": "get_weather"},
    ]
    assert render_ollama(template, messages, tools=[WEATHER_TOOL]) == (
        '[TOOLS][{"type":"function","function":{"name":"get_weather",'
        '"description":"Weather \\u003cnow\\u003e",'
        '"parameters":{"type":"object","required":["city"],"properties":{"city":{"type":"string"},'
        '"unit":{"type":["string","null"],"enum":["c","f"]}}}}}][/TOOLS]'
        "[user]Weather?"
        '[CALLS]{"name":"get_weather","arguments":{"city":"Paris","n":2,"unit":"c"}}'
        "[RESULT get_weather]21"
    )


def test_tool_printing_and_ranging() -> None:
    template = GoTemplate(
        "{{ range .Tools }}{{ .Function.Name }}:"
        "{{ range $k, $v := .Function.Parameters.Properties }}{{ $k }}={{ $v.Type }};{{ end }}{{ end }}"
        "|{{ .Tools | len }}{{ range .Messages }}{{ end }}"
    )
    assert render_ollama(template, [{"role": "user", "content": "q"}], tools=[WEATHER_TOOL]) == (
        "get_weather:city=string;unit=[string null];|1"
    )
    no_tools = GoTemplate("{{ .Tools }}|{{ json .Tools }}|{{ range .Messages }}{{ .ToolCalls }}{{ end }}")
    assert render_ollama(no_tools, [{"role": "user", "content": "q"}]) == "null|null|[]"


# Open WebUI's kind of tool: what json.Marshal must escape, a Go map (sorted) and an ordered one
# (*api.ToolPropertiesMap keeps the caller's order), `items` as a plain `any`, and a nested `required`.
WIDE_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather <now> & later",
        "parameters": {
            "type": "object",
            "properties": {
                "when": {
                    "type": "object",
                    "properties": {"day": {"type": "integer"}, "at": {"type": "string"}},
                    "required": ["day"],
                },
                "unit": {"type": ["string", "null"], "enum": ["c", "f"]},
                "location": {"type": "string", "description": "The city"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}},
            },
            "required": ["location"],
        },
    },
}
# json.Marshal(templateTool): fields in struct order (type, items omitted, function; name,
# description, parameters; type, required, properties), templateProperties' keys sorted, the nested
# ToolPropertiesMap in insertion order, ToolProperty.Required last, <>& as \u003c \u003e \u0026.
WIDE_TOOL_JSON = (
    '{"type":"function","function":{"name":"get_weather",'
    '"description":"Get the weather \\u003cnow\\u003e \\u0026 later",'
    '"parameters":{"type":"object","required":["location"],"properties":{'
    '"location":{"type":"string","description":"The city"},'
    '"tags":{"type":"array","items":{"maxLength":3,"type":"string"}},'
    '"unit":{"type":["string","null"],"enum":["c","f"]},'
    '"when":{"type":"object","properties":{"day":{"type":"integer"},"at":{"type":"string"}},"required":["day"]}'
    "}}}}"
)


def test_a_tool_prints_as_its_json() -> None:
    """`{{ . }}` over .Tools is templateTool.String() (template/template.go): its json.Marshal,
    byte for byte, where Go's struct syntax (`{function <nil> {get_weather ...}}`) used to print."""
    template = GoTemplate("{{ range .Messages }}{{ end }}{{ range .Tools }}{{ . }}|{{ printf \"%v\" . }}{{ end }}")
    out = render_ollama(template, [{"role": "user", "content": "q"}], tools=[WIDE_TOOL])
    assert out == WIDE_TOOL_JSON + "|" + WIDE_TOOL_JSON
    whole = GoTemplate("{{ range .Messages }}{{ end }}{{ .Tools }}|{{ index .Tools 0 }}|{{ json (index .Tools 0) }}")
    assert render_ollama(whole, [{"role": "user", "content": "q"}], tools=[WIDE_TOOL]) == (
        f"[{WIDE_TOOL_JSON}]|{WIDE_TOOL_JSON}|{WIDE_TOOL_JSON}"
    )


def test_only_what_has_a_string_method_in_ollama_prints_json() -> None:
    """templateToolFunction and templateToolFunctionParameters have no String(): `{{ .Function }}`
    prints Go's struct syntax in Ollama too (ollama#14601), fields that have one (the properties)
    print through it, and an api.ToolProperty prints as a struct with its PropertyType's String()."""
    template = GoTemplate(
        "{{ range .Messages }}{{ end }}{{ range .Tools }}{{ .Function }}|{{ .Function.Parameters }}|"
        "{{ .Function.Parameters.Properties.unit }}{{ end }}"
    )
    props = WIDE_TOOL_JSON.split('"properties":', 1)[1][: -len("}}}")]  # less the closing parameters, function, tool
    assert render_ollama(template, [{"role": "user", "content": "q"}], tools=[WIDE_TOOL]) == (
        f"{{get_weather Get the weather <now> & later {{object <nil> <nil> [location] {props}}}}}"
        f"|{{object <nil> <nil> [location] {props}}}"
        "|{[] [string null] <nil>  [c f] <nil> []}"
    )


# ---------------------------------------------------------------------------------------------
# Ollama's built-in templates and template.Named (templates.named)
# ---------------------------------------------------------------------------------------------


def _levenshtein_table(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab{}%\n€😀", max_size=90), st.text(alphabet="ab{}%\n€😀", max_size=90))
def test_levenshtein_is_the_edit_distance_in_code_points(a: str, b: str) -> None:
    # Past 64 characters the bit vector spans several machine words.
    assert levenshtein(a, b) == _levenshtein_table(a, b) == levenshtein(b, a)


def test_every_index_entry_names_itself() -> None:
    """Ollama's TestNamed: its testdata/templates.jsonl holds exactly index.json's jinja texts."""
    templates = named_templates()
    assert len(templates) == 37 and len({t.name for t in templates}) == 19
    for t in templates:
        found = named(t.jinja)
        assert found is not None and found.name == t.name
        assert GoTemplate(found.text).root.nodes  # every built-in parses here


SMOLLM2_JINJA = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_a_near_jinja_is_named_and_a_far_one_is_not() -> None:
    # SmolLM2's jinja is 41 edits from two chatml entries (a default system prompt): the first wins.
    found = named(SMOLLM2_JINJA)
    assert found is not None and found.name == "chatml"
    assert found.text == "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}" \
        "<|im_start|>assistant\n"
    assert found.parameters == {"stop": ["<|im_start|>", "<|im_end|>"]}
    distances = [levenshtein(SMOLLM2_JINJA, t.jinja) for t in named_templates()]
    assert min(distances) == 41 and distances.index(41) == named_templates().index(found)
    assert named("{% for m in messages %}" + "x" * 200 + "{% endfor %}") is None  # 100 edits or more: none


def test_built_in_templates_are_ollamas_files() -> None:
    """The shipped .gotmpl files are the ones the conformance data was rendered from."""
    shipped = {t.name: t.text for t in named_templates()}
    for path in _template_paths():
        if path.stem in shipped:
            assert path.read_text(encoding="utf-8") == shipped[path.stem], path.name


def test_think_values() -> None:
    template = GoTemplate("{{ range .Messages }}{{ end }}{{ .Think }}/{{ .ThinkLevel }}/{{ .IsThinkSet }}")
    messages = [{"role": "user", "content": "q"}]
    assert render_ollama(template, messages) == "false//false"
    assert render_ollama(template, messages, think=True) == "true/medium/true"
    assert render_ollama(template, messages, think=False) == "false//true"
    assert render_ollama(template, messages, think="high") == "true/high/true"
    assert render_ollama(template, messages, think="max") == "true/max/true"  # api.ThinkValue accepts "max"
    with pytest.raises(ValueError, match="invalid think value"):
        render_ollama(template, messages, think="ultra")


def test_fill_in_the_middle() -> None:
    template = GoTemplate("<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>")
    assert render_ollama(template, prompt="def f(", suffix="return 1") == "<PRE> def f( <SUF>return 1 <MID>"
    with pytest.raises(ValueError, match="suffix"):
        render_ollama(template, [{"role": "user", "content": "q"}], suffix="x")
