"""Passages and edit requests for the `copy-edit` workload: chat requests whose answers
repeat most of their prompts (editing code, fixing a paragraph), the traffic that prompt
lookup speculation is for. Written for this project."""

from __future__ import annotations

INSTRUCTIONS = (
    "Add type hints to this code and show the whole of it:",
    "Rename the variable `items` to `entries` in this code and return all of it:",
    "Add a short comment above each function and return the full code:",
    "Fix any spelling mistakes in this text and return it unchanged otherwise:",
)

PASSAGES = (
    '''def merge_intervals(items):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not items:
        return []
    items = sorted(items, key=lambda pair: pair[0])
    merged = [list(items[0])]
    for start, end in items[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged
''',
    """def word_counts(items):
    counts = {}
    for line in items:
        for word in line.lower().split():
            word = word.strip(".,;:!?")
            if word:
                counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def top_words(items, n=10):
    return [word for word, _ in word_counts(items)[:n]]
""",
    """class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key, value):
        self.items.pop(key, None)
        self.items[key] = value
        if len(self.items) > self.capacity:
            oldest = next(iter(self.items))
            del self.items[oldest]
""",
    """The lighthouse stood at the end of the rocky point, its white tower streaked with
salt. Every evening the keeper climbed the hundred and twelve steps to light the lamp,
and every morning he climbed them again to put it out. Ships passed far out at sea,
never knowing his name, but they knew his light, and that was enough for him.
""",
    """To make bread, mix flour, water, salt and yeast until the dough is smooth. Let it
rise in a warm place for an hour, then fold it, shape it into a loaf and let it rise
again. Bake it in a hot oven until the crust is brown and the loaf sounds hollow when
you tap the bottom.
""",
)
