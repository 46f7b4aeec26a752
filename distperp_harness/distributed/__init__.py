"""The process group: the rendezvous store and what a broken collective is (``store``, the leaf), collectives over
Accelerate/torch.distributed (``collective``), the store-backed control plane (``controlplane``), stopping every rank
together when one fails or node 0 is lost (``failfast``), naming a peer that is gone or stopped responding
(``liveness``) and the fault injection the failure tests use
(``testfaults``). Knows nothing of models or requests."""
