"""edge-queue: an MQTT-native job queue appliance for media work on home and edge boxes."""
