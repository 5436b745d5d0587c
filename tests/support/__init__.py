"""What several test folders share: servers on 127.0.0.1 (sshd, webhooks, S3, images, dockerd),
hosts in network namespaces, worker scripts run as `python -m tests.support.<name>`, polling
(wait.py) and the checkout as shipped (checkout.py)."""
