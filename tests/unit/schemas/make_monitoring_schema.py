"""Writes monitoring.coreos.com_v1.json beside this file: the JSON schemas of prometheus-operator's
ServiceMonitor and PodMonitor, from the PyPI package cloudcoil-models-prometheus-operator (pydantic
models generated from the operator's released CRDs; the package's version is the operator's, plus a
fourth number). Kept in the repository so that the test suite reads the schema offline and needs
neither that package nor its pytest plugin. To move to a newer operator release:

    pip install 'cloudcoil-models-prometheus-operator==X.Y.Z.N'
    python tests/unit/schemas/make_monitoring_schema.py
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

from cloudcoil.models.prometheus_operator import v1

PACKAGE = "cloudcoil-models-prometheus-operator"


def main() -> None:
    out = {"source": f"{PACKAGE}=={importlib.metadata.version(PACKAGE)} (pydantic's model_json_schema)",
           "schemas": {kind: getattr(v1, kind).model_json_schema() for kind in ("ServiceMonitor", "PodMonitor")}}
    path = Path(__file__).with_name("monitoring.coreos.com_v1.json")
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
