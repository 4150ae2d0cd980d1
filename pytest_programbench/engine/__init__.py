"""The Docker engines: clients, backpressure, disk checks, ownership labels and the reaper, images, exec streams."""
