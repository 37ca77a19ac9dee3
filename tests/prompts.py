"""Varied prompts for the engine tests: chat, code, lists, prose and long documents, so
that lengths span ~20 to ~600 tokens and token statistics differ."""

from __future__ import annotations

PARAGRAPHS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
    "one hundred and twelve steps out of habit rather than necessity. From the lamp room "
    "he could see the fishing boats returning, their hulls low with the day's catch.",
    "def fibonacci(n: int) -> list[int]:\n    seq = [0, 1]\n    while len(seq) < n:\n"
    "        seq.append(seq[-1] + seq[-2])\n    return seq[:n]\n\nprint(fibonacci(10))\n",
    "Photosynthesis converts light energy into chemical energy. Chlorophyll absorbs mostly "
    "blue and red light, reflecting green, which is why leaves look green to us. The "
    "process produces glucose and releases oxygen as a by-product.",
    "Shopping list: 2 kg potatoes, 1 dozen eggs, olive oil, fresh basil, 500 g pasta, "
    "parmesan, cherry tomatoes, garlic (3 heads), lemons, sparkling water, dark chocolate.",
    "In 1869 the Suez Canal opened, shortening the sea route between Europe and Asia by "
    "about 7,000 kilometres. Its construction took ten years and employed tens of "
    "thousands of workers, many of them conscripted.",
    "SELECT customer_id, COUNT(*) AS orders, SUM(total) AS revenue\nFROM orders\n"
    "WHERE created_at >= '2024-01-01'\nGROUP BY customer_id\nHAVING COUNT(*) > 3\n"
    "ORDER BY revenue DESC\nLIMIT 20;",
]

QUESTIONS = [
    "What is the capital of Australia?",
    "Summarise the text above in one sentence.",
    "Write a haiku about autumn rain.",
    "Explain what the code above prints and why.",
    "List three uses of a paperclip.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "What are the main risks described above?",
    "Continue the story.",
]


def document(n_paragraphs: int, offset: int = 0) -> str:
    return "\n\n".join(PARAGRAPHS[(offset + i) % len(PARAGRAPHS)] for i in range(n_paragraphs))


def varied_conversations(n: int) -> list[list[dict[str, str]]]:
    """n single-turn chats whose documents grow from none to ~10 paragraphs."""
    convs = []
    for i in range(n):
        doc = document(i * 10 // max(n - 1, 1), offset=i)
        question = QUESTIONS[i % len(QUESTIONS)]
        content = f"{doc}\n\n{question}" if doc else question
        convs.append([{"role": "user", "content": content}])
    return convs
