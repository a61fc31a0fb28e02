"""GPUs faked for the tests of what the programs do on them (the machines here have none):
TensorFlow's list of physical devices, their details, and the memory growth set on them."""

A100 = {"device_name": "NVIDIA A100-SXM4-80GB", "compute_capability": (8, 0)}
T4 = {"device_name": "Tesla T4", "compute_capability": (7, 5)}


def faker(monkeypatch):
    """Patches TensorFlow through `monkeypatch` to list no GPU; returns `install(*details)`, which
    makes it list one GPU of each `details` (a dict as `get_device_details` gives) and returns the
    list into which ``set_memory_growth`` calls go, as ``(device name, enable)``."""
    import tensorflow as tf

    listed, grown = [], []
    real = tf.config.list_physical_devices

    def install(*details):
        listed[:] = [(tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU"), detail)
                     for i, detail in enumerate(details)]
        return grown

    monkeypatch.setattr(tf.config, "list_physical_devices", lambda device_type=None: (
        [device for device, _ in listed] if device_type == "GPU" else real(device_type)))
    monkeypatch.setattr(tf.config.experimental, "get_device_details",
                        lambda device: dict(listed)[device])
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth",
                        lambda device, enable: grown.append((device.name, enable)))
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    return install
