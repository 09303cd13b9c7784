"""A small client: send a prompt to a running worker and stream the decoded text.

    python -m servicer.client --text "The river"
    python -m servicer.client --chat "Tell me about the sea." --max-tokens 64

It fetches the tokenizer from the worker (GetTokenizer), so it needs nothing but the address.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from .proto import common_pb2
from .proto import mlx_engine_pb2 as pb
from .proto import mlx_engine_pb2_grpc as pb_grpc


@dataclass
class RemoteTokenizer:
    """The worker's own tokenizer, rebuilt from its GetTokenizer archive and loaded as mlx-lm
    loads it (Hugging Face's AutoTokenizer), so prompts are encoded as mlx-lm encodes them."""

    tokenizer: Any  # the Hugging Face tokenizer

    @classmethod
    def fetch(cls, stub: pb_grpc.MlxEngineStub, timeout: float = 30) -> RemoteTokenizer:
        chunks = stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=timeout)
        return cls.from_archive(b"".join(chunk.data for chunk in chunks))

    @classmethod
    def from_archive(cls, data: bytes) -> RemoteTokenizer:
        from .model_files import load_tokenizer

        with tempfile.TemporaryDirectory(prefix="mlx-grpc-client-") as directory:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                for name in archive.namelist():
                    # Flat file names only: the archive holds the model directory's files.
                    if Path(name).name == name and name not in ("", ".", ".."):
                        (Path(directory) / name).write_bytes(archive.read(name))
            return cls(load_tokenizer(Path(directory)))

    def encode(self, text: str) -> list[int]:
        """Raw text with the tokenizer's special tokens (its BOS, where it has one), as
        `mlx_lm.generate` encodes a prompt."""
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def encode_chat(self, message: str) -> list[int]:
        """A user message through the model's chat template (tokenizer_config.json's
        `chat_template` or chat_template.jinja); the template writes the special tokens."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise SystemExit("the model has no chat template; use --text")
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m servicer.client", description=__doc__)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--text", help="raw text prompt")
    prompt.add_argument("--chat", help="a user message, rendered with the model's chat template")
    parser.add_argument("--address", default="127.0.0.1:50051", help="worker host:port")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, help="default 1.0; 0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for the whole call")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        stub = pb_grpc.MlxEngineStub(channel)
        tokenizer = RemoteTokenizer.fetch(stub)
        ids = tokenizer.encode_chat(args.chat) if args.chat else tokenizer.encode(args.text)
        params = pb.SamplingParams(
            max_tokens=args.max_tokens, top_p=args.top_p, ignore_eos=args.ignore_eos
        )
        if args.temperature is not None:
            params.temperature = args.temperature
        request = pb.GenerateRequest(
            request_id=f"client-{uuid.uuid4().hex[:12]}",
            tokenized=pb.TokenizedInput(input_ids=ids),
            sampling_params=params,
            stream=True,
        )
        generated: list[int] = []
        complete: pb.GenerateComplete | None = None
        shown = ""
        started = time.perf_counter()
        try:
            for response in stub.Generate(request, timeout=args.timeout):
                if response.HasField("chunk"):
                    generated.extend(response.chunk.token_ids)
                    text = tokenizer.decode(generated)
                    if not text.endswith("\ufffd"):  # wait for the rest of a split character
                        sys.stdout.write(text[len(shown) :])
                        sys.stdout.flush()
                        shown = text
                else:
                    complete = response.complete
        except grpc.RpcError as error:
            print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
        sys.stdout.write(tokenizer.decode(generated)[len(shown) :] + "\n")
        elapsed = time.perf_counter() - started
        if complete is None:
            print("error: the stream ended without a finish", file=sys.stderr)
            return 1
        print(
            f"[{complete.finish_reason}: {complete.prompt_tokens} prompt + "
            f"{complete.completion_tokens} generated tokens in {elapsed:.2f} s]",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
