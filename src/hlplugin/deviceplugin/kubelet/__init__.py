"""The kubelet side: the socket the kubelet dials (endpoint), registration, the lifecycle that keeps
a plugin registered across kubelet restarts, the gRPC server and the servicer base with its seams
(interfaces). Imports the health wing and the package root, never the process wing."""
