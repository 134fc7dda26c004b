"""The kubelet side: two protocols, each in its own wing, over what both share.

- ``deviceplugin``: the device-plugin API (v1beta1): the lifecycle that keeps a plugin registered
  across kubelet restarts, its server instances, Register, kubelet.sock, the servicer base with its
  seams (interfaces.py), the device lists, how the lifecycle stands for the daemon's probes;
- ``dra``: dynamic resource allocation: the plugin-watcher registration, the DRA service (v1 and
  v1beta1), the resource-health stream, the one writer of a node's shared file, the claims'
  checkpoint.

Shared here, and importing neither wing: the socket a kubelet dials (endpoint.py: one owner per
path), every gRPC server of ours with its bounds and our self-call (grpcserver.py), the call
context every handler takes (context.py), and the instance's ``Role`` (role.py), which the
device-plugin lifecycle flips and a daemon's writers of shared files read. Neither wing imports the other
(tests/test_layers.py). Imports the health wing and the package root, never the process wing.
"""
