"""What happens to jobs in the loop's turns: outcomes stored, jobs scheduled, retention, recovery at
boot and after each connect."""
