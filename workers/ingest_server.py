"""Run the trajstore HTTP ingest service (same as ``trajstore serve``).

    TRAJSTORE_TOKEN=secret python workers/ingest_server.py --store sqlite:///store.db --port 8700
"""

from trajstore.ingest.service import main

if __name__ == "__main__":
    main()
