"""Run the OpenAI-compatible recording proxy (same as ``trajstore proxy``).

    python workers/proxy.py --store sqlite:///store.db --upstream http://127.0.0.1:8000 --port 8701
"""

from trajstore.ingest.proxy import main

if __name__ == "__main__":
    main()
