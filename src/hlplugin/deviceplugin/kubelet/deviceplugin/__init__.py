"""The device-plugin API (deviceplugin/v1beta1) as the kubelet's device manager speaks it: a
``PluginLifecycle`` serves a daemon's servicer on its socket, registers it with kubelet.sock and
keeps it registered across kubelet restarts and hand-overs. Imports the shared kubelet modules,
never the DRA wing."""
