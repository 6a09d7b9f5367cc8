"""What tests, benchmarks and the demo build on: models, volumes, a Hub, kill trials.

* `loaderplug.testing.volume`: the parent side, `mounted` and `TestVolume` (start here);
* `loaderplug.testing.faults`: the `VolumeProfile` and its fault model;
* `loaderplug.testing.fuse_server`: the FUSE server, run as its own process;
* `loaderplug.testing.model`: synthetic model files;
* `loaderplug.testing.eviction`: the kernel dropping its dentry and inode caches;
* `loaderplug.testing.hub`: a local stand-in for the Hugging Face Hub;
* `loaderplug.testing.tiny_llama`: a tiny Llama for vLLM and transformers;
* `loaderplug.testing.vllm_runner`: vLLM on the CPU, its recipe and its cases;
* `loaderplug.testing.crash`: kill trials and soaks; `slowed`: the CLI with slowed reads;
* `loaderplug.testing.hosts`: several hosts on one machine (namespaces, shaped links).

Nothing is imported here: ``python -m loaderplug.testing.fuse_server`` runs this
package's ``__init__`` first, and the server should load no more than it needs.
"""
