"""Run inside the edge host's namespace: stream completions and print one JSON line per event.

    python stream_client.py URL MODEL N_REQUESTS MAX_TOKENS
"""

import json
import sys
import threading

from openai import OpenAI


def main() -> None:
    url, model, n, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    lock = threading.Lock()

    def one(i: int) -> None:
        text, finish, error = [], None, None
        try:
            stream = client.completions.create(
                model=model, prompt=f"Request {i}: the quick brown fox", max_tokens=max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )
            for count, chunk in enumerate(stream):
                if chunk.choices:
                    text.append(chunk.choices[0].text)
                    finish = chunk.choices[0].finish_reason or finish
                if count == 20:
                    with lock:
                        print(json.dumps({"event": "streaming", "request": i}), flush=True)
        except Exception as exc:  # reported, not raised: the test decides
            error = f"{type(exc).__name__}: {exc}"
        with lock:
            print(json.dumps({"event": "done", "request": i, "text": "".join(text), "finish": finish, "error": error}), flush=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
