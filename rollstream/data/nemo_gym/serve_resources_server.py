"""Serve one NeMo Gym resources server, unmodified, on a Unix socket: run INSIDE a job's sandbox by
the nemo-gym runtime's Python (rollstream.tasks.nemo_gym_env writes this file there; rollstream
never imports it). The server class and its config class are the package's own, built as NeMo
Gym's own tests build them (the config from its fields, a ServerClient for servers that call
others); only NeMo Gym's launcher (ng_run: a head server, Ray, a port) is left out, since the
sandbox has no network and the job's worker is the only client.

Usage: python serve_resources_server.py NAME SOCKET [CONFIG-JSON]"""

import importlib
import inspect
import json
import sys

import uvicorn
from nemo_gym.base_resources_server import SimpleResourcesServer
from nemo_gym.config_types import BaseServerConfig
from nemo_gym.server_utils import ServerClient
from omegaconf import OmegaConf


def server_class(name: str) -> type:
    module = importlib.import_module(f"resources_servers.{name}.app")
    found = [cls for _, cls in inspect.getmembers(module, inspect.isclass)
             if issubclass(cls, SimpleResourcesServer) and cls.__module__ == module.__name__
             and not inspect.isabstract(cls)]
    if len(found) != 1:
        sys.exit(f"resources_servers.{name}.app defines {len(found)} resources server classes; expected one")
    return found[0]


def main() -> None:
    name, socket_path = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    cls = server_class(name)
    config_cls = cls.model_fields["config"].annotation
    config = config_cls.model_validate({"host": "127.0.0.1", "port": 0, "entrypoint": "app.py", "name": name,
                                        **extra})
    client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=0),
                          global_config_dict=OmegaConf.create({}))
    app = cls(config=config, server_client=client).setup_webserver()
    uvicorn.run(app, uds=socket_path, log_level="warning")


if __name__ == "__main__":
    main()
