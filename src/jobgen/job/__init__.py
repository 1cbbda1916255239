"""The job description: everything a user writes, read and checked before anything is rendered.

    models.py           the typed job (pydantic): every field a job file may hold
    nccl.py             NCCL's variables: each launch.network preset and why, one setting per variable
    layers.py           bundled defaults < site profile < job file < --set overrides
    dump.py             a job written back as YAML (complete, or as set)
    sites.py            site profiles: where they are found, their defaults and limits
    sweep.py            a sweep: --sweep and --sweep-file read into points, each point's name and job
    yamlfile.py         reading a user's YAML file; textfile.py: a file that is not UTF-8
    sources.py          the data files (JSON, JSONL, Parquet, a datasets folder), read a chunk at a time
    conversations.py    each record checked and made a sample, in its format (the trainer reads it with this)
    record_formats.py   one record of each format read field by field (ShareGPT, OpenAI, Alpaca, text, ids)
    model_reference.py  training.model: a local folder or a hub name
    model_config.py     what the model's config.json says about loading it (quantization, custom code)
    hub_cache.py        a hub model in the Hugging Face cache the nodes use; hub_stage.py: staging it there
    hub_api.py          the hub itself, asked once with a short timeout: a model's name, revision and config
    preflight.py        what the login node can check of the job's files before the queue

Imports only the shared modules below the parts (jobgen.errors, files, resources, plugins);
nothing here imports torch.
"""
