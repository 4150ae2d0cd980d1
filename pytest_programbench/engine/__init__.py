"""The Docker engines, below everything that runs a container.

``docker_engine`` (one :class:`Engine` per engine and process: first contact, retries, restart detection, the run's
labels and the sweep) opens its clients through ``engine_api`` (docker-py's API client with every call handed to the
engine); ``protocol`` names what each side relies on (``EngineCalls``, and ``DockerEngine``: a client as its callers
use it). ``engines`` leases engines to tasks; ``backpressure`` caps heavy calls across workers; ``disk`` checks room;
``ownership`` and ``reaper`` find and remove dead runs' leftovers; ``images`` resolves and builds task images;
``container``, ``exec_stream``, ``tar_in`` and ``archive_out`` move bytes in and out of containers; ``facts`` is
what was learnt about an engine; ``errors`` the infrastructure errors.
"""
