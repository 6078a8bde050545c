"""The benchmark prompts, shared by every bench script (and the llama-server comparison)."""

from __future__ import annotations

CODE_TO_EDIT = '''import json
import os


def load_config(path):
    with open(path) as f:
        data = json.load(f)
    return data


def save_config(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def merge_configs(base, override):
    result = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge_configs(result[key], value)
        else:
            result[key] = value
    return result


def get_value(data, dotted_key, default=None):
    node = data
    for part in dotted_key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def set_value(data, dotted_key, value):
    parts = dotted_key.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
'''

PASSAGE = (
    "The lighthouse at Skerry Point was built in 1852, after three ships were lost on the reef in a single "
    "winter. For most of its history it was kept by the Marsh family, who lived in the cottage at the foot "
    "of the tower and climbed its one hundred and twelve steps several times each night to trim the wicks "
    "and wind the clockwork that turned the great lens. The lens itself, a first-order Fresnel lens made in "
    "Paris, weighed nearly four tonnes and floated on a bath of mercury so that a single keeper could turn "
    "it by hand if the clockwork failed. On clear nights its beam could be seen from twenty miles away. "
    "Life at the station was hard. Supplies came by boat once a fortnight, weather permitting, and in the "
    "worst winters the family went six weeks without a delivery, living on salted fish, potatoes from the "
    "garden and rainwater collected from the roof. The children were taught at home by their mother until "
    "the age of twelve, when they were sent to the mainland to finish school. Several of them later became "
    "keepers themselves, at stations along the same coast. In 1923 the oil lamp was replaced by an "
    "acetylene burner, and in 1961 the light was electrified. The last keeper, Thomas Marsh, left the "
    "station in 1987 when the light was automated, ending one hundred and thirty-five years of family "
    "service. Today the tower is maintained by a heritage trust, the cottage has become a small museum, "
    "and the old lens, retired in favour of a modern rotating beacon, is displayed in the lamp room where "
    "visitors can see it catch the afternoon sun. The reef, once the terror of the coast, is now marked on "
    "every chart, and no ship has been lost there since the light was first lit."
)

PROMPTS: dict[str, str] = {
    "code": "Write a Python function that reads a CSV file and returns the average of every numeric "
    "column. Include a docstring and handle missing values.",
    "edit": "Here is a Python module:\n\n" + CODE_TO_EDIT + "\nAdd type hints to every function and "
    "rename `data` to `config` everywhere. Reply with the complete edited module only.",
    "summarise": "Summarise the following passage in one paragraph, keeping the key dates and names:\n\n"
    + PASSAGE,
    "story": "Write a story about a fox who learns to sail a small boat across a lake.",
}


def chat(text: str) -> str:
    """SmolLM2's ChatML rendering of one user turn (what /api/chat sends for these prompts)."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
