"""Write benchmarks/data/t2i-50.jsonl: 50 prompt/seed pairs for `kvrelay bench`.

Deterministic (no randomness beyond a fixed seed list); the token counts come from the built-in
byte-level tokenizer, which makes prompts longer than a subword tokenizer would (about one token per
byte plus BOS): results state them. Run: python benchmarks/make_dataset.py
"""

from __future__ import annotations

import json
from pathlib import Path

SUBJECTS = [
    "a lighthouse on a cliff at sunset", "a red fox in fresh snow", "an astronaut riding a horse on the moon",
    "a bowl of ramen with steam rising", "a medieval castle in the fog", "a hummingbird next to a hibiscus flower",
    "a cyberpunk street market at night in the rain", "a cozy reading nook with a cat asleep on a pile of books",
    "a sailboat on a calm turquoise lagoon", "a steam locomotive crossing a stone viaduct",
    "a field of sunflowers under a thunderstorm", "an old fisherman mending nets on a wooden pier",
    "a glass terrarium with tiny mushrooms", "a snowy mountain village with glowing windows",
    "a koi pond in a japanese garden in autumn", "a vintage red bicycle leaning against a brick wall",
    "a desert canyon at golden hour", "a robot watering plants in a greenhouse",
    "a jazz band playing in a smoky club", "a polar bear on drifting ice",
]
STYLES = [
    "oil painting", "watercolor", "studio photograph, 85mm, shallow depth of field", "pixel art",
    "ukiyo-e woodblock print", "isometric 3d render", "charcoal sketch", "art nouveau poster",
    "cinematic still, volumetric light", "children's book illustration",
]
NEGATIVES = ["blurry, low quality", "text, watermark, signature", "extra limbs, deformed hands", "oversaturated, noisy"]


def main() -> None:
    from kvrelay.models.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    out = Path(__file__).parent / "data" / "t2i-50.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(50):
        prompt = f"{SUBJECTS[i % len(SUBJECTS)]}, {STYLES[(i * 3) % len(STYLES)]}"
        if i % 4 == 1:
            prompt += ", highly detailed, intricate textures, dramatic composition, trending on an art forum"
        negative = NEGATIVES[i % len(NEGATIVES)] if i % 2 == 0 else ""
        rows.append(
            {
                "id": i,
                "prompt": prompt,
                "negative_prompt": negative,
                "seed": 1000 + 37 * i,
                "prompt_tokens": len(tokenizer.encode(prompt)),
                "negative_prompt_tokens": len(tokenizer.encode(negative)),
            }
        )
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out}: {len(rows)} rows, prompt tokens {min(r['prompt_tokens'] for r in rows)}..{max(r['prompt_tokens'] for r in rows)}")


if __name__ == "__main__":
    main()
