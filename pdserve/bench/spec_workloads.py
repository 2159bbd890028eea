"""`pdserve bench spec`'s prompts: a repetitive workload (code edits, quoting summaries, an
agent loop that repeats its tool outputs: answers that copy their input) and free chat."""

from __future__ import annotations

from typing import Any

WORKLOADS = ("repetitive", "chat")
Chat = list[dict[str, str]]

FUNCTIONS = (
    "def moving_average(values, window):\n    x = 0.0\n    out = []\n"
    "    for i, value in enumerate(values):\n        x += value\n        if i >= window:\n"
    "            x -= values[i - window]\n        if i >= window - 1:\n"
    "            out.append(x / window)\n    return out\n",
    "def count_words(text):\n    x = {}\n    for word in text.lower().split():\n"
    "        word = word.strip('.,;:!?')\n        if word:\n"
    "            x[word] = x.get(word, 0) + 1\n"
    "    return sorted(x.items(), key=lambda item: -item[1])\n",
    "def clamp_all(items, low, high):\n    x = []\n    for item in items:\n"
    "        if item < low:\n            x.append(low)\n        elif item > high:\n"
    "            x.append(high)\n        else:\n            x.append(item)\n    return x\n",
)
PASSAGES = (
    "The lighthouse at Port Ellen was built in 1832. Its keeper climbed 121 steps every evening "
    "to light the lamp. In winter storms the light could be seen from twenty miles away. The "
    'keeper wrote in his log: "The sea was angry tonight, but the lamp never faltered." The '
    "lighthouse was automated in 1978, and the keeper's cottage became a museum.",
    "Honeybees share the way to food with a movement called the waggle dance. A forager back "
    "at the hive dances a figure of eight. The angle of the dance tells the other bees the "
    "direction of the flowers relative to the sun, and the length of the waggle run tells them "
    'the distance. The scientist who decoded it called it "the most remarkable language in the '
    'animal kingdom."',
    'The town council met on Tuesday to discuss the new bridge. The mayor said: "The bridge '
    'will open in the spring, and it will cut the drive to the hospital by ten minutes." Two '
    "members asked about the cost, which has risen to 4.2 million pounds. The council voted "
    "seven to two to continue the work.",
)
QUESTIONS = (
    "Write a short poem about the sea.",
    "What are three tips for learning a new language?",
    "Explain why the sky is blue.",
    "Describe your ideal weekend.",
    "Tell me a story about a dragon who loves baking.",
    "What is the difference between weather and climate?",
    "Give me ideas for a birthday party.",
    "How do plants make their food?",
)


def code_edit(i: int) -> Chat:
    code = FUNCTIONS[i % len(FUNCTIONS)]
    ask = "Here is a function. Rename the variable x to y and return the whole function."
    return [{"role": "user", "content": f"{ask}\n\n```python\n{code}```"}]


def quoting_summary(i: int) -> Chat:
    ask = "Summarize this passage in two sentences, quoting its most important sentence exactly."
    return [{"role": "user", "content": f"{ask}\n\n{PASSAGES[i % len(PASSAGES)]}"}]


def agent_loop(i: int) -> Chat:
    """An agent's conversation whose later turns repeat an earlier tool output."""
    listing = "\n".join(f"src/module_{i}_{n}.py  {1200 * (n + 1) + 37 * i} bytes" for n in range(6))
    call = {"role": "assistant", "content": 'Calling list_files(path="src/").'}
    return [
        {"role": "system", "content": "You are a coding agent. Report tool outputs exactly."},
        {"role": "user", "content": "List the files in src/ with their sizes."},
        call,
        {"role": "user", "content": f"Tool output:\n{listing}"},
        {"role": "assistant", "content": f"The files in src/ are:\n{listing}"},
        {"role": "user", "content": "List them again and report the output exactly as before."},
        call,
        {"role": "user", "content": f"Tool output:\n{listing}"},
    ]


def workload_chats(workload: str, n: int) -> list[Chat]:
    """n conversations of a workload: repetitive cycles code edit, quoting summary, agent loop."""
    if workload == "chat":
        return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]
    kinds = (code_edit, quoting_summary, agent_loop)
    return [kinds[i % len(kinds)](i // len(kinds)) for i in range(n)]


def tokenize_chats(tokenizer: Any, chats: list[Chat]) -> list[list[int]]:
    """Each conversation through the model's chat template, ready for the assistant's turn."""
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
             for c in chats]  # fmt: skip
    return [tokenizer(t).input_ids for t in texts]
