from edge_queue.cli.launch import main

main()
