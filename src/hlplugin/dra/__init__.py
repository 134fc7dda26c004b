"""`hlplugin dra`, the DRA driver: the same proofs as the device plugin's, behind Dynamic Resource
Allocation (docs/dra.md). Two sides, as k8s.io/dynamic-resource-allocation has them:

- the kubelet's (kubeletplugin): ``driver`` runs the daemon and its root tasks; ``claims``
  answers NodePrepareResources and NodeUnprepareResources, gated on the proofs; ``record`` is
  what a prepared claim keeps in the checkpoint; ``allocation`` reads a new claim's allocation
  from the API server.
- the control plane's (resourceslice): ``slices`` publishes and keeps this node's
  ResourceSlice; ``controlplane`` runs it as one more root task of the driver.

The Kubernetes API client both use is ``hlplugin.kubeapi``, a wing of its own that the kubelet
protocols (``hlplugin.deviceplugin.kubelet``) never import. ``allocation``, ``slices`` and
``controlplane`` are imported only when the driver runs in a cluster (tests/test_lean_imports.py).
"""
