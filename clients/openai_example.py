"""The official ``openai`` SDK against a tlt-serve server, unchanged (``pip install openai``).

    tlt-serve serve &                      # the default model on 127.0.0.1:30000
    python -m clients.openai_example --url http://127.0.0.1:30000

Chat completion, a streamed completion, and n samples with logprobs (the target's).
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=os.environ.get("TLT_SERVE_API_KEY", "none"))
    args = ap.parse_args()

    import openai

    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key)
    model = client.models.list().data[0].id

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Start with 4. Add 3, then multiply by 2. "
                   "What number do you end with?"}],
        max_tokens=64,
        temperature=0,
    )
    print("chat:", chat.choices[0].message.content)

    print("stream: ", end="", flush=True)
    for chunk in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=16, temperature=0,
        stream=True,
    ):
        print(chunk.choices[0].text, end="", flush=True)
    print()

    out = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=8, n=3, temperature=1.0, logprobs=1,
    )
    for c in out.choices:
        lps = (c.logprobs.token_logprobs if c.logprobs else None) or []
        print(f"sample {c.index}: {c.text!r}  sum logprob {sum(lps):.2f}")


if __name__ == "__main__":
    main()
