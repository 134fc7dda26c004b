"""Dynamic resource allocation's kubelet side (k8s.io/dynamic-resource-allocation's
``kubeletplugin``): a ``WatcherPlugin`` registered through the kubelet's plugin watcher, the DRA
service over one ``Preparer``, the resource-health stream, which instance writes the node's
shared file (writer.py), and the checksummed checkpoint of prepared claims. Imports the shared
kubelet modules, never the device-plugin wing."""
