"""`pyhlo bench`: pyhlo's speed against its peers, one module per job.

  command      the options and which benchmark runs (`pyhlo bench`'s entry point)
  settings     the run's settings from the options: defaults, --quick, checks
  machine      the machine: CPU, versions, memory bandwidth, a device's presence and copy rate,
               and other processes' CPU use while we measure
  worker       the worker protocol: one engine in a child process, driven by JSON lines
  pyhlo_runner pyhlo as the worker runs it, and its from_pretrained options at each precision
  peers        HF transformers and llama.cpp as the worker runs them, and llama.cpp's GGUF files
  rounds       one precision and batch size: every engine's worker, a warm-up, rounds taking turns
  cpu          the CPU benchmark (the default): pyhlo, HF transformers and llama.cpp
  device       `--device cpu|cuda`: pyhlo, HF eager and HF static cache + torch.compile
  serve        `--serve`: `pyhlo serve` against llama.cpp's server
  speculative  `--speculative K`: speculative decoding's speed-up
  block_products  one prefill product of a GGUF block weight, each way pyhlo can run it
  stats        the numbers behind a row: medians, decode speed, roofline, buckets
  report       the reports of the CPU and device benchmarks: their dicts, notes, markdown, JSON, PNG
"""
