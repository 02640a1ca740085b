"""The short story openings (TinyStories style) that the checks and tests generate from; each
takes the first few."""

from __future__ import annotations

STORY_PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily went to the park and",
    "One day, a boy named Tim",
    "The sun was",
    "Sam had a red ball. He",
    "There was a big tree",
    "Mom said",
    "The cat and the bird",
    "A girl found a shiny",
    "Tom was sad because",
    "They played all day",
    "The fish swam",
    "Ben wanted to",
    "It was a rainy day",
    "The princess",
    "A small bug",
    "Max and his friend",
    "At night, the moon",
    "The old man had",
    "She looked at the sky and",
    "The car was fast",
]
