"""Prompt sets of the speculative-decoding benchmarks (``bench/engine.py --speculative``, ``bench/serve.py
--speculative``): chat messages (OpenAI form), rendered by the model's own chat template.

* ``GROUNDED``: input-grounded tasks whose answer reuses spans of the prompt (quote or repeat a paragraph,
  summarize a given text, edit given code, extract fields of a given text to JSON, reformat given data):
  what n-gram (prompt-lookup) drafting is for.
* ``OPEN``: open-ended chat (a poem, an explanation, a story): little of the answer is in the prompt, so
  drafts are rarely right; speculation should cost little there.

Plain data, no imports: ``bench/serve.py`` loads it next to itself.
"""

from __future__ import annotations

_PARAGRAPH = (
    "The lighthouse at Carrow Point was built in 1871 from granite quarried on the island itself. For "
    "ninety years a keeper and his family lived in the cottage at its foot, trimming the wick every four "
    "hours and winding the clockwork that turned the lens. In 1962 the light was electrified, and in 1988 "
    "the last keeper left; since then the lamp has been switched on and off by a timer, and the cottage "
    "has been a small museum open from May to September."
)

_ARTICLE = (
    "City officials announced on Tuesday that the Riverside bridge will close for repairs from March 3 to "
    "June 14. The bridge, which carries about 40,000 vehicles a day, has shown cracks in two of its support "
    "beams since an inspection last autumn. During the closure, buses will be rerouted over the Mill Street "
    "bridge, and a temporary ferry will run every fifteen minutes between the north and south docks from 6 am "
    "to 10 pm. The repairs are expected to cost 12 million dollars, of which the state will pay two thirds. "
    "Shop owners near the bridge said they were worried about losing customers, and the city council has "
    "promised a fund of 500,000 dollars to help affected businesses. The mayor said the work could not wait "
    "any longer, because further damage would force a much longer closure next year."
)

_CODE = """def calc(items, tax):
    x = 0
    for item in items:
        x = x + item["price"] * item["quantity"]
    x = x + x * tax
    return x


def calc_discount(items, tax, discount):
    x = calc(items, tax)
    if discount > 0:
        x = x - x * discount
    return x
"""

_BIO = (
    "Hello, my name is Daniel Okafor and I work as a senior data engineer at Northwind Logistics in "
    "Rotterdam. I joined the company in 2019 after five years at a bank. You can reach me by email at "
    "daniel.okafor@northwind.example or by phone at +31 10 555 0192. I am 38 years old and I speak English, "
    "Dutch and Igbo."
)

_CSV = """name,country,population,capital
Norway,Europe,5500000,Oslo
Kenya,Africa,54000000,Nairobi
Peru,South America,34000000,Lima
Vietnam,Asia,98000000,Hanoi
Canada,North America,39000000,Ottawa
"""

_EMAIL = (
    "Hi Alice,\n\nThank you for sending the report on Friday. Alice, I read it over the weekend and I think "
    "the section on costs is very clear. Could you add the numbers for the second quarter before the meeting "
    "on Thursday? If you need help, ask Alice's team or me.\n\nBest regards,\nTom"
)

_LIST = "- bananas\n- apples\n- oranges\n- cherries\n- pears\n- grapes\n- lemons\n- melons\n- plums\n- kiwis"

GROUNDED: list[tuple[str, list[dict]]] = [
    (
        "repeat",
        [{"role": "user", "content": f"Repeat the following paragraph word for word:\n\n{_PARAGRAPH}"}],
    ),
    (
        "summarize",
        [
            {
                "role": "user",
                "content": f"Summarize the following news article in three sentences:\n\n{_ARTICLE}",
            }
        ],
    ),
    (
        "code-edit",
        [
            {
                "role": "user",
                "content": "In this Python code, rename the variable `x` to `total` everywhere and add a "
                f"docstring to each function. Output the whole updated code.\n\n```python\n{_CODE}```",
            }
        ],
    ),
    (
        "extract-json",
        [
            {
                "role": "user",
                "content": "Extract the name, job title, company, city, email, phone and age from the text "
                f'below as a JSON object with the keys "name", "title", "company", "city", "email", "phone", '
                f'"age".\n\nText: {_BIO}',
            }
        ],
    ),
    (
        "csv-table",
        [{"role": "user", "content": f"Convert this CSV data into a Markdown table:\n\n{_CSV}"}],
    ),
    (
        "email-rewrite",
        [
            {
                "role": "user",
                "content": "Rewrite the following email, replacing the name Alice with Maria everywhere. Keep "
                f"everything else exactly the same.\n\n{_EMAIL}",
            }
        ],
    ),
    (
        "quote-answer",
        [
            {
                "role": "user",
                "content": f"{_ARTICLE}\n\nQuote the sentences of the article above that mention money, "
                "exactly as they are written.",
            }
        ],
    ),
    (
        "list-sort",
        [
            {
                "role": "user",
                "content": f"Sort this shopping list alphabetically and keep the dashes:\n\n{_LIST}",
            }
        ],
    ),
]

OPEN: list[tuple[str, list[dict]]] = [
    ("poem", [{"role": "user", "content": "Write a poem about the sea at night."}]),
    ("sky-blue", [{"role": "user", "content": "Explain why the sky is blue."}]),
    ("story", [{"role": "user", "content": "Tell me a short story about a robot who learns to paint."}]),
    ("exercise", [{"role": "user", "content": "What are the benefits of regular exercise?"}]),
    ("bicycle", [{"role": "user", "content": "How does a bicycle stay upright while it moves?"}]),
    ("language", [{"role": "user", "content": "Give me some tips for learning a new language as an adult."}]),
    ("cats", [{"role": "user", "content": "Why do cats purr?"}]),
    (
        "letter",
        [{"role": "user", "content": "Write a letter to a friend about your summer holiday by a lake."}],
    ),
]

SETS: dict[str, list[tuple[str, list[dict]]]] = {"grounded": GROUNDED, "open": OPEN}


def interleaved(n: int) -> list[tuple[str, str, list[dict]]]:
    """``n`` requests cycling through both sets, one of each in turn: ``(set name, prompt name, messages)``."""
    both = [(s, name, m) for pair in zip(GROUNDED, OPEN) for s, (name, m) in zip(("grounded", "open"), pair)]
    return [both[i % len(both)] for i in range(n)]
