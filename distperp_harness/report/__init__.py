"""What a run reports: the returned score (``results``), perplexity/KL aggregations (``metrics``), what
quantization costs per task (``quantcost``) and WikiText article splitting for the tasks (``wikitext``)."""
